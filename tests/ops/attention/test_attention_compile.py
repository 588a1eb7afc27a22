"""The paged-attention kernel over a float8 cache, compiled for sm_90 on the CPU machine
(kvserve.ops.triton_offline): its V conversion is inline PTX, which Triton's interpreter does not
run (the interpreter tests take the .to() path), so this is what CI can check of the path a
GPU takes. Its numerics are checked on a GPU (test_triton_attention.py's gpu tests)."""

from __future__ import annotations

import pytest

from kvserve.ops.attention import paged_attention
from kvserve.ops.triton_offline import compile_kernel, cuda_tool, resource_usage

TYPES = {"out_ptr": "*fp32", "max_ptr": "*fp32", "sum_ptr": "*fp32", "q_ptr": "*bf16", "k_cache_ptr": "*fp8e4nv",
         "v_cache_ptr": "*fp8e4nv", "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32",
         "query_start_loc_ptr": "*i32", "qk_scale": "fp32", "v_scale": "fp32"}
# The tiles of narrow decode batches, which read their metadata before their PDL wait.
NARROW_TILES = (paged_attention.DECODE_TILE, paged_attention.SHORT_DECODE_TILE)
DIVISIBLE = ("num_heads", "stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_cache_block",
             "stride_cache_slot", "stride_cache_head")


@pytest.mark.parametrize("tile", [paged_attention.DECODE_TILE, paged_attention.WIDE_DECODE_TILE,
                                  paged_attention.SHORT_DECODE_TILE], ids=["decode", "wide-decode", "short-decode"])
def test_float8_decode_attention_compiles_for_sm90_with_v_through_ldmatrix(tile) -> None:
    """llama3-8b's heads (4 queries a KV head, head_dim 128), bf16 queries over an e4m3
    cache, split KV: V converts to fp16 as loaded (the PTX conversion), reaches the dot
    through ldmatrix.trans rather than a byte at a time, and nothing spills."""
    compiled = compile_kernel(
        paged_attention._paged_attention_kernel,
        dict(BLOCK_SIZE=16, SPLIT=True, GROUP=4, GROUP_PAD=4, HEAD_DIM=128, BLOCK_M=tile.block_m,
             BLOCK_N=tile.block_n, DOT_PRECISION="tf32", FP16_DOTS=True, V_FLOAT8_ASM="e4m3", PDL=True,
             EARLY_METADATA=tile in NARROW_TILES, NEW_KV=False, NEW_KEYS=0, TREE=False),
        num_warps=tile.num_warps, num_stages=tile.num_stages, types=TYPES, divisible=DIVISIBLE)
    registers, stack = resource_usage(compiled)
    assert stack == 0, f"{registers} registers and {stack} bytes of stack (spilled)"
    assert "cvt.rn.f16x2.e4m3x2" in compiled.asm["ptx"]
    sass = cuda_tool("nvdisasm", compiled.asm["cubin"], "-c")
    assert "LDSM.16.MT88" in sass  # ldmatrix.trans: V as the dot's transposed operand
    assert "LDS.U8" not in sass  # the byte-at-a-time gather the PTX conversion avoids
    # A link of the PDL chain; narrow decode batches read their metadata before the wait.
    ptx = compiled.asm["ptx"]
    first_load, wait = ptx.find("ld.global"), ptx.find("griddepcontrol.wait")
    assert min(first_load, wait) >= 0
    assert (first_load < wait) == (tile in NARROW_TILES)


@pytest.mark.parametrize("split", [True, False], ids=["split", "unsplit"])
def test_decode_attention_with_rope_and_cache_write_compiles_for_sm90(split) -> None:
    """The short-context tile applying RoPE and storing the new K/V itself (NEW_KV), bf16 over
    a bf16 cache at llama3-8b's heads: no spill, and the metadata (with the token's cos, sin
    and slot) still loads before the PDL wait."""
    tile = paged_attention.SHORT_DECODE_TILE
    types = {**TYPES, "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "key_ptr": "*bf16", "value_ptr": "*bf16",
             "cos_ptr": "*fp32", "sin_ptr": "*fp32", "slot_mapping_ptr": "*i64"}
    compiled = compile_kernel(
        paged_attention._paged_attention_kernel,
        dict(BLOCK_SIZE=16, SPLIT=split, GROUP=4, GROUP_PAD=4, HEAD_DIM=128, BLOCK_M=tile.block_m,
             BLOCK_N=tile.block_n, DOT_PRECISION="tf32", FP16_DOTS=False, V_FLOAT8_ASM="", PDL=True,
             EARLY_METADATA=True, NEW_KV=True, NEW_KEYS=0, TREE=False),
        num_warps=tile.num_warps, num_stages=tile.num_stages, types=types,
        divisible=(*DIVISIBLE, "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_cs"))
    registers, stack = resource_usage(compiled)
    assert stack == 0, f"{registers} registers and {stack} bytes of stack (spilled)"
    ptx = compiled.asm["ptx"]
    wait = ptx.find("griddepcontrol.wait")
    assert wait >= 0 and ptx.count("ld.global", 0, wait) >= 4  # the sequence's metadata, cos, sin, slot


@pytest.mark.parametrize(("rows", "new_keys", "tree"), [(32, 16, False), (64, 16, False), (64, 16, True)],
                         ids=["5-tokens", "9-tokens", "9-tokens-tree"])
@pytest.mark.parametrize("split", [True, False], ids=["split", "unsplit"])
def test_verify_attention_with_rope_and_cache_write_compiles_for_sm90(rows, new_keys, tree, split) -> None:
    """The short-context tile holding a verify step's whole width (llama3-8b's 4 heads a KV
    head: 5 and 9 tokens pad to 32 and 64 rows), rotating it and attending the step's new keys
    as one more tile (NEW_KEYS), with a token tree's visibility bits (TREE: what the verify
    graphs run): no spill."""
    tile = paged_attention.SHORT_DECODE_TILE
    types = {**TYPES, "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "key_ptr": "*bf16", "value_ptr": "*bf16",
             "cos_ptr": "*fp32", "sin_ptr": "*fp32", "slot_mapping_ptr": "*i64", "tree_bits_ptr": "*i64"}
    compiled = compile_kernel(
        paged_attention._paged_attention_kernel,
        dict(BLOCK_SIZE=16, SPLIT=split, GROUP=4, GROUP_PAD=4, HEAD_DIM=128, BLOCK_M=rows,
             BLOCK_N=tile.block_n, DOT_PRECISION="tf32", FP16_DOTS=False, V_FLOAT8_ASM="", PDL=True,
             EARLY_METADATA=True, NEW_KV=False, NEW_KEYS=new_keys, TREE=tree),
        num_warps=tile.num_warps, num_stages=tile.num_stages, types=types,
        divisible=(*DIVISIBLE, "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_cs"))
    registers, stack = resource_usage(compiled)
    assert stack == 0, f"{registers} registers and {stack} bytes of stack (spilled)"
