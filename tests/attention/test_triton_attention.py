"""TritonAttentionBackend against the torch reference on random paged batches.

Without a GPU the kernels run under Triton's interpreter on small sizes, all in one
subprocess (tests/triton_interpreter.py). The full-size matrix runs on CUDA (marked gpu).
"""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import dataclass

import pytest
import torch

from kvserve.attention.metadata import AttentionMetadata
from kvserve.attention.torch_ref import TorchReferenceBackend
from kvserve.model_executor.layers.rotary import RotaryEmbedding, apply_rotary
from kvserve.spec_decode.tree import tree_attention_mask
from tests.triton_interpreter import run_interpreted

# Worst per-token relative error ||out - ref|| / ||ref|| against an fp32 reference.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


@dataclass(frozen=True)
class Case:
    scenario: str
    seqs: tuple[tuple[int, int], ...]  # (context length incl. new tokens, new tokens)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int = 16
    num_kv_splits: int | None = None  # None: the backend's own choice
    cache_dtype: torch.dtype | None = None  # None: the query's; float8 caches store K/V / KV_SCALES
    # q and k handed over unrotated, with RoPE's (cos, sin): narrow decode batches rotate and
    # write inside the attention kernel, others rotate first. qk_views: q, k and v as views of
    # one q/k/v buffer (the model's layout); else separate tensors (as after q/k norms).
    rotary: bool = False
    qk_views: bool = True
    # Token trees (TREE_MAX_QUERIES or fewer query tokens): the newest token then draft
    # nodes in a binary tree, each seeing its ancestors only (tree_attention_mask).
    tree: bool = False

    @property
    def id(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        splits = "" if self.num_kv_splits is None else f"-splits{self.num_kv_splits}"
        cache = "" if self.cache_dtype is None else "-cache_" + str(self.cache_dtype).removeprefix("torch.")
        return (
            f"{self.scenario}-{dtype}-d{self.head_dim}-h{self.num_heads}kv{self.num_kv_heads}"
            f"-bs{self.block_size}{splits}{cache}{'-rotary' if self.rotary else ''}"
            f"{'' if self.qk_views else '-separate'}{'-tree' if self.tree else ''}"
        )


TREE_MAX_QUERIES = 16
# Per-tensor scales of the float8 caches: random normal K/V over them stay inside e4m3's 448.
KV_SCALES = (0.02, 0.03)


def make_batch(case: Case, device: str, seed: int = 0):
    """Random q/k/v and a cache holding each sequence's prefix at shuffled blocks, the rest
    of the cache random too (so reading a wrong slot shows)."""
    generator = torch.Generator().manual_seed(seed)
    bs, kvh, dim = case.block_size, case.num_kv_heads, case.head_dim
    blocks_per_seq = [-(-length // bs) for length, _ in case.seqs]
    num_blocks = sum(blocks_per_seq) + 3
    free_blocks = torch.randperm(num_blocks, generator=generator).tolist()
    kv_cache = torch.randn(2, num_blocks, bs, kvh, dim, generator=generator)
    block_tables = torch.zeros(len(case.seqs), max(blocks_per_seq), dtype=torch.int32)
    flat = kv_cache.view(2, -1, kvh, dim)
    keys, values, slot_mapping = [], [], []
    for i, (length, q_len) in enumerate(case.seqs):
        blocks = [free_blocks.pop() for _ in range(blocks_per_seq[i])]
        block_tables[i, : len(blocks)] = torch.tensor(blocks)
        slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(length)])
        k, v = torch.randn(2, length, kvh, dim, generator=generator)
        prefix = length - q_len
        flat[0, slots[:prefix]], flat[1, slots[:prefix]] = k[:prefix], v[:prefix]
        keys.append(k[prefix:])
        values.append(v[prefix:])
        slot_mapping.append(slots[prefix:])
    q_lens = [q_len for _, q_len in case.seqs]
    starts = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    seq_lens = [length for length, _ in case.seqs]
    query = torch.randn(starts[-1], case.num_heads, dim, generator=generator)
    metadata = AttentionMetadata(
        slot_mapping=torch.cat(slot_mapping).to(device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        block_size=bs,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
        tree_masks={i: tree_attention_mask(1, [-1 if n < 2 else (n - 2) // 2 for n in range(q_len - 1)], device)
                    for i, q_len in enumerate(q_lens) if 2 <= q_len <= TREE_MAX_QUERIES} if case.tree else None,
    )
    to = dict(device=device, dtype=case.dtype)
    query, keys, values = query.to(**to), torch.cat(keys).to(**to), torch.cat(values).to(**to)
    if case.rotary and case.qk_views:
        qkv = torch.cat([query, keys, values], dim=1)
        query, keys, values = qkv.split([case.num_heads, kvh, kvh], dim=1)
    if case.cache_dtype is not None:
        scales = torch.tensor(KV_SCALES).view(2, 1, 1, 1, 1)
        kv_cache = (kv_cache / scales).to(case.cache_dtype)
    else:
        kv_cache = kv_cache.to(case.dtype)
    return query, keys, values, kv_cache.to(device), metadata


def rope_cos_sin(metadata: AttentionMetadata, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, head_dim / 2] fp32 cos and sin at each new token's context position."""
    positions = torch.cat([torch.arange(length - (end - start), length) for length, start, end in zip(
        metadata.seq_lens_cpu, metadata.query_start_loc_cpu, metadata.query_start_loc_cpu[1:])])
    return RotaryEmbedding(head_dim, 10000.0, None).cos_sin(positions)


def torch_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rotary's torch path, in x's dtype (on CPU, where it does not dispatch to Triton)."""
    return apply_rotary(x.cpu(), cos, sin).to(x.device)


def check_case(case: Case, device: str) -> None:
    from kvserve.attention.triton_backend import TritonAttentionBackend

    query, key, value, kv_cache, metadata = make_batch(case, device)
    scale = case.head_dim**-0.5
    float8 = case.cache_dtype is not None
    kv_scales = KV_SCALES if float8 else (1.0, 1.0)
    rotary, ref_query, ref_key = None, query, key
    if case.rotary:
        cos, sin = rope_cos_sin(metadata, case.head_dim)
        rotary = (cos.to(device), sin.to(device))
        # The reference gets q and k rotated by the torch path, in the run dtype.
        ref_query, ref_key = torch_rotary(query, cos, sin), torch_rotary(key, cos, sin)
    # A float8 reference cache stays float8 (the reference writes and reads it scaled).
    ref_cache = kv_cache.clone() if float8 else kv_cache.float()
    expected = TorchReferenceBackend().forward(
        ref_query.float(), ref_key.float(), value.float(), ref_cache, metadata, scale, kv_scales=kv_scales
    )
    out = TritonAttentionBackend(case.num_kv_splits).forward(
        query, key, value, kv_cache, metadata, scale, kv_scales=kv_scales, rotary=rotary
    )
    assert out.shape == query.shape and out.dtype == query.dtype
    assert torch.isfinite(out).all(), "non-finite output"
    error = ((out.float() - expected).norm(dim=(1, 2)) / expected.norm(dim=(1, 2))).max().item()
    assert error <= TOLERANCE[case.dtype], f"relative error {error:.2e}"
    # The cache equals the reference's: new slots written, every other slot untouched.
    if float8:
        assert torch.equal(kv_cache.view(torch.uint8), ref_cache.view(torch.uint8)), "KV cache differs"
    elif case.rotary:
        # Rotated keys may differ from the torch path's by an ulp or two of the tensor's scale
        # on a GPU (as the rotary kernel's may, tests/ops/test_elementwise.py).
        ulps = 2 * torch.finfo(case.dtype).eps
        torch.testing.assert_close(kv_cache.float(), ref_cache, rtol=0, atol=ulps * ref_cache.abs().max().item())
        written = torch.zeros(kv_cache[0].numel() // (kv_cache.shape[-1] * kv_cache.shape[-2]), dtype=torch.bool,
                              device=device)
        written[metadata.slot_mapping] = True
        got, ref = (c.view(2, -1, *c.shape[-2:])[:, ~written] for c in (kv_cache.float(), ref_cache))
        assert torch.equal(got, ref), "a slot outside the step's was written"
    else:
        assert torch.equal(kv_cache.float(), ref_cache), "KV cache differs from the reference's"


# -- small cases for the interpreter --------------------------------------------------------

SMALL_SCENARIOS: dict[str, tuple[tuple[int, int], ...]] = {
    "decode": ((37, 1), (1, 1), (16, 1), (70, 1)),
    "prefill": ((37, 37), (5, 5)),
    "prefill_prefix": ((37, 12), (50, 3)),
    "mixed": ((9, 1), (21, 21), (45, 7), (1, 1), (6, 4)),
}
# A speculative verify step: 1 + k query tokens per sequence over the whole context.
VERIFY_SEQS = ((37, 5), (70, 3), (5, 5), (16, 1))
SMALL_CASES = [
    *(
        Case(scenario, seqs, h, kvh, 64, torch.float32)
        for scenario, seqs in SMALL_SCENARIOS.items()
        for h, kvh in ((2, 2), (8, 2), (7, 1), (8, 1))
    ),
    *(
        Case(scenario, seqs, 8, 1, 128, torch.bfloat16)
        for scenario, seqs in SMALL_SCENARIOS.items()
    ),
    Case("decode", SMALL_SCENARIOS["decode"], 8, 2, 64, torch.float32, num_kv_splits=4),
    Case("decode", SMALL_SCENARIOS["decode"], 4, 1, 128, torch.float16, num_kv_splits=3),
    Case("verify", VERIFY_SEQS, 8, 2, 64, torch.float32, num_kv_splits=4),
    Case("mixed", SMALL_SCENARIOS["mixed"], 8, 2, 64, torch.float32, block_size=5),
    Case("mixed", SMALL_SCENARIOS["mixed"], 7, 1, 64, torch.float16),
    # float8 caches under bf16 queries (the dots run in fp16); 16 sequences take the wide tile.
    Case("decode", SMALL_SCENARIOS["decode"], 8, 2, 64, torch.bfloat16, cache_dtype=torch.float8_e4m3fn),
    Case("decode_wide", tuple((5 + 3 * i, 1) for i in range(16)), 4, 1, 64, torch.bfloat16,
         cache_dtype=torch.float8_e4m3fn),
    Case("mixed", SMALL_SCENARIOS["mixed"], 8, 2, 64, torch.bfloat16, cache_dtype=torch.float8_e5m2),
    Case("prefill_prefix", SMALL_SCENARIOS["prefill_prefix"], 8, 2, 64, torch.float16,
         cache_dtype=torch.float8_e4m3fn),
    # RoPE handed to the backend: decode batches on the short plan (4 splits of 32 keys, one
    # of them empty), padded head groups among them, rotate and write inside the attention
    # kernel; the 256-key tile (forced splits), prefill, mixed, wide and fp32 batches rotate
    # first.
    *(Case("decode", SMALL_SCENARIOS["decode"], h, kvh, 64, dtype, rotary=True)
      for dtype in (torch.bfloat16, torch.float16) for h, kvh in ((8, 2), (7, 1))),
    Case("decode", SMALL_SCENARIOS["decode"], 4, 1, 128, torch.bfloat16, num_kv_splits=3, rotary=True),
    Case("decode", SMALL_SCENARIOS["decode"], 8, 2, 64, torch.float32, rotary=True),
    Case("decode_wide", tuple((5 + 3 * i, 1) for i in range(16)), 8, 2, 64, torch.bfloat16, rotary=True),
    # 64 sequences of at most 384 keys: the 32-key tile unsplit, rotating and writing inside.
    Case("decode_many", tuple((1 + 37 * i % 90, 1) for i in range(64)), 4, 1, 64, torch.bfloat16, rotary=True),
    Case("mixed", SMALL_SCENARIOS["mixed"], 8, 2, 64, torch.bfloat16, rotary=True),
    Case("prefill_prefix", SMALL_SCENARIOS["prefill_prefix"], 7, 1, 64, torch.float16, rotary=True),
    Case("decode", SMALL_SCENARIOS["decode"], 8, 2, 64, torch.bfloat16, rotary=True, qk_views=False),
    Case("mixed", SMALL_SCENARIOS["mixed"], 8, 2, 64, torch.bfloat16, rotary=True, qk_views=False),
    # Verify steps on the short plan (4 splits; (5, 5) has no cached keys, so its other splits
    # are empty): each sequence's whole width in one program, which rotates and writes the new
    # K/V and attends them as their own tile; 32 and 64 rows (group 7 pads to 8).
    Case("verify", VERIFY_SEQS, 8, 2, 64, torch.bfloat16, rotary=True),
    Case("verify", VERIFY_SEQS, 7, 1, 64, torch.float16, rotary=True),
    Case("verify", VERIFY_SEQS, 8, 2, 64, torch.bfloat16, rotary=True, qk_views=False),
    # 9 tokens x 8 heads do not fit 64 rows: two programs a sequence on the short tile, RoPE first.
    Case("verify_wide", ((40, 9), (20, 9), (9, 9)), 8, 1, 64, torch.bfloat16, rotary=True),
    # A float8 cache: the short tile, RoPE and the cache write ahead of it.
    Case("verify", VERIFY_SEQS, 8, 2, 64, torch.bfloat16, cache_dtype=torch.float8_e4m3fn),
    # Token trees: in the key loop (fp32, and split 4 ways), among the new keys of the fused
    # short tile, and beside a 70-token prefill chunk, which keeps its causal mask.
    Case("verify", VERIFY_SEQS, 8, 2, 64, torch.float32, tree=True),
    Case("verify", VERIFY_SEQS, 8, 2, 64, torch.float32, num_kv_splits=4, tree=True),
    Case("verify", VERIFY_SEQS, 8, 2, 64, torch.bfloat16, rotary=True, tree=True),
    Case("mixed_tree", ((100, 70), (45, 7), (9, 1), (20, 5)), 8, 2, 64, torch.float32, tree=True),
]


def test_rotary_cases_take_both_paths() -> None:
    """The small rotary cases cover RoPE inside the attention kernel (narrow decode batches)
    and RoPE ahead of it (every other batch); the interpreter runs them."""
    from kvserve.ops.attention.paged_attention import DecodePlan, choose_decode_plan, fuses_new_kv

    fused = {}
    for case in SMALL_CASES:
        if case.rotary:
            query, _, _, kv_cache, metadata = make_batch(case, "cpu")
            plan = (DecodePlan(case.num_kv_splits) if case.num_kv_splits is not None
                    else choose_decode_plan(metadata, case.num_kv_heads, kv_cache.dtype, torch.device("cpu")))
            group = case.num_heads // case.num_kv_heads
            fused[case.id] = fuses_new_kv(metadata, plan.tile, query.dtype, kv_cache.dtype, group)
    # The 16-bit "decode" cases (4 sequences), decode_many (64) and the verify steps that fit a
    # program on the short plan fuse; forced splits (the 256-key tile), decode_wide (32
    # programs), verify_wide, mixed, prefill and fp32 batches do not.
    assert fused == {id: id.startswith(("decode-", "decode_many-", "verify-")) and "float32" not in id
                     and "splits" not in id for id in fused}
    assert sum(fused.values()) == 10 and len(fused) == 17


def run_small_cases() -> None:
    """Subprocess entry: print {case id: error or null} as JSON."""
    from kvserve.ops.attention.paged_attention import warm_up

    results = {}
    for case in SMALL_CASES:
        try:
            check_case(case, "cpu")
            results[case.id] = None
        except AssertionError as error:
            results[case.id] = str(error)
    # The start-up warm-up launches its ten variants on a cache of one block and of many: seven,
    # the short-context plan taking RoPE and the cache write, and the short tile unsplit (wide
    # batches), with and without. Verify steps of up to 9 tokens (group 4) add the short tile
    # at 16, 32 and 64 rows, each unfused and fused.
    launches = [warm_up(torch.zeros(2, blocks, 16, 2, 64, dtype=torch.float16), 8, torch.float16, 16, width)
                for blocks, width in ((1, 1), (5, 1), (5, 9))]
    results["warm_up"] = None if launches == [10, 10, 16] else f"launches {launches}"
    print(json.dumps(results))


@pytest.fixture(scope="module")
def interpreted_results() -> dict[str, str | None]:
    pytest.importorskip("triton")
    return json.loads(run_interpreted("tests.attention.test_triton_attention", "run_small_cases"))


@pytest.mark.parametrize("case", SMALL_CASES, ids=lambda case: case.id)
def test_interpreted_matches_reference(case: Case, interpreted_results) -> None:
    assert interpreted_results[case.id] is None, interpreted_results[case.id]


def test_interpreted_warm_up_launches_every_variant(interpreted_results) -> None:
    assert interpreted_results["warm_up"] is None, interpreted_results["warm_up"]


# -- full sizes on the GPU ------------------------------------------------------------------


def _random_seqs(seed: int, count: int, max_len: int, new_tokens) -> tuple[tuple[int, int], ...]:
    rng = random.Random(seed)
    seqs = []
    for _ in range(count):
        length = rng.randint(1, max_len)
        seqs.append((length, min(length, new_tokens(rng))))
    return tuple(seqs)


GPU_SCENARIOS: dict[str, tuple[tuple[tuple[int, int], ...], int, int | None]] = {
    # name: (seqs, block size, forced splits)
    "decode": (((1, 1), (4097, 1), *_random_seqs(1, 30, 3000, lambda r: 1)), 16, None),
    "decode_split": (((5000, 1), (17, 1), (1, 1), (1203, 1)), 16, 7),
    # One or two sequences of up to 2048 keys: the short-context plan (choose_decode_plan)
    # wherever the cache is not fp32 and there are at most 16 (sequence, KV head) programs.
    "decode_short": (((1000, 1),), 16, None),
    "decode_short_pair": (((700, 1), (40, 1)), 16, None),
    "decode_short_long": (((2000, 1),), 16, None),
    # 64 sequences of at most 384 keys (16-bit caches: the 32-key tile unsplit).
    "decode_many_short": (_random_seqs(4, 64, 384, lambda r: 1), 16, None),
    "verify_split": (((5000, 5), (17, 5), (3, 3), (1203, 2)), 16, 7),
    # Verify steps of one or two sequences over at most 4096 keys: the short-context plan,
    # fused where the width fits a program (rotary cases).
    "verify_short": (((1000, 5), (300, 9)), 16, None),
    "verify_short_one": (((257, 5),), 16, None),
    "verify_short_long": (((4000, 5), (2500, 3)), 16, None),
    "verify_short_long_one": (((3000, 5),), 16, None),  # one sequence past 2048 keys: 32 splits
    "prefill": (((300, 300), (1, 1), (77, 77), (513, 513)), 16, None),
    "prefill_prefix": (((1500, 200), (700, 2), (64, 63), (2100, 129)), 16, None),
    "mixed": (_random_seqs(2, 40, 2500, lambda r: r.choice([1, 1, 1, r.randint(2, 300)])), 16, None),
    "mixed_bs5": (_random_seqs(3, 12, 700, lambda r: r.choice([1, r.randint(2, 90)])), 5, None),
}
GPU_CASES = [
    Case(scenario, seqs, h, kvh, dim, dtype, block_size, splits)
    for scenario, (seqs, block_size, splits) in GPU_SCENARIOS.items()
    for dtype in (torch.bfloat16, torch.float16)
    for dim in (64, 128)
    for h, kvh in ((8, 8), (32, 8), (28, 4), (64, 8))
] + [
    Case(scenario, seqs, 32, 8, 128, dtype, block_size, splits, cache_dtype)
    for scenario, (seqs, block_size, splits) in GPU_SCENARIOS.items()
    for dtype, cache_dtype in ((torch.bfloat16, torch.float8_e4m3fn), (torch.bfloat16, torch.float8_e5m2),
                               (torch.float16, torch.float8_e4m3fn))
] + [
    Case(scenario, seqs, h, kvh, dim, dtype, block_size, splits, rotary=True)
    for scenario, (seqs, block_size, splits) in GPU_SCENARIOS.items()
    for dtype, dim, (h, kvh) in ((torch.bfloat16, 128, (32, 8)), (torch.float16, 64, (28, 4)))
] + [
    # q and k as separate tensors (as after q/k norms): fused on the short plan, else rotated first.
    Case(scenario, GPU_SCENARIOS[scenario][0], 32, 8, 128, torch.bfloat16, rotary=True, qk_views=False)
    for scenario in ("decode_short", "verify_short", "mixed")
] + [
    # Token trees of up to 16 query tokens: forced splits, the short plan (fused where the
    # rotary is handed over), and beside prefill chunks that stay causal.
    Case(scenario, seqs, 32, 8, 128, torch.bfloat16, 16, splits, rotary=rotary, tree=True)
    for scenario, seqs, splits in (
        ("verify_split", GPU_SCENARIOS["verify_split"][0], 7),
        ("verify_short_tree", ((1000, 16), (300, 9), (40, 16)), None),
        ("verify_long_tree", ((4000, 16), (2500, 3)), None),
        ("mixed", GPU_SCENARIOS["mixed"][0], None),
    )
    for rotary in (False, True)
]


def test_gpu_short_scenarios_take_the_short_plan() -> None:
    """The decode_short and verify_short scenarios are there to check the short-context plan
    on a GPU, at these split counts."""
    from kvserve.ops.attention.paged_attention import SHORT_DECODE_TILE, choose_decode_plan

    splits = {"decode_short": 32, "decode_short_pair": 32, "decode_short_long": 32, "verify_short": 16,
              "verify_short_one": 16, "verify_short_long": 16, "verify_short_long_one": 32}
    for case in GPU_CASES:
        if case.scenario in splits:
            _, _, _, kv_cache, metadata = make_batch(case, "cpu")
            plan = choose_decode_plan(metadata, case.num_kv_heads, kv_cache.dtype, torch.device("cpu"))
            expected = splits[case.scenario]
            if case.scenario == "verify_short_long" and case.num_kv_heads == 4:
                expected = 32  # two sequences of 4 KV heads: 8 programs, as one of 8 heads
            assert plan == (expected, SHORT_DECODE_TILE), case.id


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda case: case.id)
def test_gpu_matches_reference(case: Case) -> None:
    check_case(case, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_warm_up_leaves_nothing_to_compile(dtype: torch.dtype) -> None:
    """After the start-up warm-up (for verify steps of up to 9 tokens a sequence), steps of
    every kind (decodes of 1-40 sequences, forced and chosen splits, verify widths on the
    prefill and the short-context tiles, prefills, mixed batches, block tables of any width)
    compile no further attention kernel variant."""
    from kvserve.ops.attention import paged_attention as kernels

    jit_kernels = (kernels._paged_attention_kernel, kernels._merge_splits_kernel)
    for kernel in jit_kernels:
        kernel.device_caches.clear()  # what other tests compiled must not count
    device = torch.cuda.current_device()
    cache = torch.zeros(2, 8, 16, 8, 128, dtype=dtype, device="cuda")
    kernels.warm_up(cache, 32, dtype, 16, max_width=9)
    compiled = [set(kernel.device_caches[device][0]) for kernel in jit_kernels]
    for scenario, (seqs, block_size, splits) in GPU_SCENARIOS.items():
        if block_size != 16:
            continue
        for forced, rotary in itertools.product({splits, None}, (False, True)):
            check_case(Case(scenario, seqs, 32, 8, 128, dtype, block_size, forced, rotary=rotary), "cuda")
    for width, rotary in itertools.product((1, 3, 16, 40), (False, True)):
        # Decode batches of these sizes, long contexts: chosen splits.
        seqs = tuple((1000 + 37 * i, 1) for i in range(width))
        check_case(Case("decode", seqs, 32, 8, 128, dtype, rotary=rotary), "cuda")
    added = [set(kernel.device_caches[device][0]) - warm for kernel, warm in zip(jit_kernels, compiled)]
    assert added == [set(), set()], f"compiled after the warm-up: {added}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_selector_picks_triton_on_cuda() -> None:
    from kvserve.attention.selector import get_attn_backend
    from kvserve.attention.triton_backend import TritonAttentionBackend

    assert isinstance(get_attn_backend(torch.device("cuda")), TritonAttentionBackend)


def test_selector_on_cpu() -> None:
    from kvserve.attention.selector import get_attn_backend

    assert isinstance(get_attn_backend(torch.device("cpu")), TorchReferenceBackend)
    assert isinstance(get_attn_backend(torch.device("cpu"), "torch"), TorchReferenceBackend)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        get_attn_backend(torch.device("cpu"), "triton")
    with pytest.raises(ValueError, match="Unknown attention backend"):
        get_attn_backend(torch.device("cpu"), "flash")
