"""Weight-only matmul on the GPU for the quantized layers: y = x @ W^T with W read in its
stored form (int8, 4-bit nibble pairs or float8_e4m3fn) and scaled in the loop, so a
decode step moves the packed bytes once instead of a dequantized copy.

W[n, k] = q[n, k] * scale[n, g] + offset[n, g] with g = k // group_size (per-channel:
one group per row). q converts exactly to the activation dtype (|int8| <= 128, nibbles,
e4m3 values are all bf16/fp16 numbers), so each tile's product runs on tensor cores in
fp32 accumulation (block_m 1: on the CUDA cores instead) and the group's scale (and
offset * sum(x)) is applied to the tile's partial sum afterwards. Up to 16 rows pad to one
16-row tile (reads W once); split-K over fixed fp32 partials, summed in a fixed order by
torch, fills the GPU when N is small. int8 weights, and fp8 rows that are not whole
tiles of K, always take these kernels.

4-bit weights at up to 64 rows (INT4_DECODE_CONFIGS) and fp8 weights at up to 16 rows
(FP8_DECODE_CONFIGS) take the int32-word kernels instead, multiplied on the CUDA cores
("fma", few rows) or on tensor cores ("dot": W x^T, a wgmma on sm_90). 4-bit: 8 nibbles a
load, each put into the mantissa of 1.0f by a shift and one LOP3 (f = 1 + q / 128, no
int-to-float conversion); 128 scale and (offset - 128 scale) * sum(x) apply per group, and
a tile may hold two groups (longer runs of each weight row per load). At 2-32 rows on CUDA,
4-bit weights go through mma.sync instead ("mma"): each thread builds its own tensor-core
A fragment from the words it loaded (two nibbles a LOP3, as bf16/fp16 magic + q), which
halves the instructions a weight against the CUDA-core loop and serves 8 rows of x for the
price of one; 9-32 rows take 2-4 such tiles of x against each fragment, unpacked once
(mma.int4_mma_kernel). fp8 weights likewise at 2-16 rows (mma.fp8_mma_kernel: e4m3 to
fp16 by the hardware, x's bf16 pairs to fp16, fp16 MMAs) where the GPU is not a Hopper: on
Hopper, Fp8Linear sends 2-128 rows to the fp8 x fp8 kernel (ops/quant/fp8_w8a8.py).
fp8: 4 e4m3 values a load, each byte converted by the hardware (exact); per-channel scales
apply once at the end, group scales once per tile. Their split-K partials are summed
inside the kernel, in split order, by the last split to finish: one launch per linear.

The 4-bit one-row word kernel can also run the residual add and the RMSNorm after its
linear in its epilogue (weight_only_matmul_add_norm: h * the norm's weight and the row sums
of h^2), and the next linear's word or mma.sync kernel scales its output rows by
rsqrt(mean(h^2) + eps) (weight_only_matmul's `pending`): the norm's own kernel goes away
(PendingNorm, ops/quant/pending_norm.py).

No host syncs and only shape-dependent allocations (the split counters are allocated once
per device, at the first call): the launches are CUDA-graph capturable.

Modules: configs (launch configurations and routing), matmul (weight_only_matmul: picks and
launches), generic (tl.dot tiles and the one-row loop for any stored form), words (the
int32-word kernels), mma (the mma.sync kernels), tiles (the Triton helpers they share),
unpack (unpack_weight for the dense path).
"""

from kvserve.ops.quant.weight_only.configs import LaunchConfig, default_config
from kvserve.ops.quant.weight_only.matmul import weight_only_matmul
from kvserve.ops.quant.weight_only.unpack import unpack_weight

__all__ = ["LaunchConfig", "default_config", "unpack_weight", "weight_only_matmul"]
