"""The start-up warm-up against the attention kernel variants real batches launch, on CPU: every
launch is recorded by its compile key (what makes Triton compile a new variant: constexprs,
launch options, argument dtypes, and the integers and pointers it specialises on) instead of
run, on an H100's 132 multiprocessors. The GPU test (test_warm_up_leaves_nothing_to_compile)
reads Triton's own cache, but only on a GPU; this runs the same batches in CI."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvserve.attention import triton_backend
from kvserve.attention.metadata import AttentionMetadata
from kvserve.ops.attention import paged_attention
from tests.attention.test_triton_attention import GPU_SCENARIOS, Case, rope_cos_sin


def zero_batch(case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """q, k and v (views of one buffer, as the model hands them over), a cache and the metadata
    of case's batch, all zeros: only shapes, dtypes and strides reach a compile key."""
    q_lens, seq_lens = [q_len for _, q_len in case.seqs], [length for length, _ in case.seqs]
    starts = [0, *itertools.accumulate(q_lens)]
    blocks = max(-(-length // case.block_size) for length in seq_lens)
    metadata = AttentionMetadata(
        slot_mapping=torch.zeros(starts[-1], dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.zeros(len(seq_lens), blocks, dtype=torch.int32),
        block_size=case.block_size, max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts, seq_lens_cpu=seq_lens,
    )
    heads, kv_heads, dim = case.num_heads, case.num_kv_heads, case.head_dim
    query, key, value = torch.zeros(starts[-1], heads + 2 * kv_heads, dim, dtype=case.dtype).split(
        [heads, kv_heads, kv_heads], dim=1)
    kv_cache = torch.zeros(2, 4, case.block_size, kv_heads, dim, dtype=case.dtype)
    return query, key, value, kv_cache, metadata


class RecordedKernel:
    """Stands in for a JITFunction: `kernel[grid](*args, **options)` records the compile key."""

    def __init__(self, kernel, keys: set) -> None:
        self.params = kernel.params
        self.param_names = [param.name for param in kernel.params]
        self.keys = keys

    def __getitem__(self, grid):
        return self.launch

    def launch(self, *args, **kwargs) -> None:
        values = dict(zip(self.param_names, args)) | kwargs
        key = []
        for param in self.params:
            value = values[param.name]
            if param.is_constexpr:
                key.append((param.name, value))
            elif isinstance(value, torch.Tensor):
                key.append((param.name, value.dtype, value.data_ptr() % 16 == 0))
            elif isinstance(value, int) and not param.do_not_specialize:
                key.append((param.name, value == 1, value % 16 == 0))
        options = {name: value for name, value in values.items() if name not in self.param_names}
        self.keys.add((self.params[0].name, tuple(key), tuple(sorted(options.items()))))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_warm_up_compiles_every_variant_the_gpu_scenarios_launch(monkeypatch, dtype) -> None:
    """After warm_up for verify steps of up to 9 tokens, the GPU test's batches (decodes on
    every plan, verify widths, prefills, mixed; RoPE handed over or not) and decode batches of
    1-40 sequences launch no kernel variant the warm-up did not."""
    keys: set = set()
    for name in ("_paged_attention_kernel", "_merge_splits_kernel"):
        monkeypatch.setattr(paged_attention, name, RecordedKernel(getattr(paged_attention, name), keys))
    monkeypatch.setattr(paged_attention.device_info, "num_sms", lambda device, off_gpu=1: 132)
    # Batches that rotate first run these kernels, which are not the attention's variants.
    monkeypatch.setattr(triton_backend, "rotary_queries_and_keys_", lambda *args: None)
    monkeypatch.setattr(triton_backend, "write_kv_cache", lambda *args: None)

    paged_attention.warm_up(torch.zeros(2, 8, 16, 8, 128, dtype=dtype), 32, dtype, 16, max_width=9)
    warmed = set(keys)
    assert warmed
    cases = [Case(scenario, seqs, 32, 8, 128, dtype, block_size, forced, rotary=rotary)
             for scenario, (seqs, block_size, splits) in GPU_SCENARIOS.items() if block_size == 16
             for forced, rotary in itertools.product({splits, None}, (False, True))]
    cases += [Case("decode", tuple((1000 + 37 * i, 1) for i in range(width)), 32, 8, 128, dtype, rotary=rotary)
              for width, rotary in itertools.product((1, 3, 16, 40, 64), (False, True))]
    for case in cases:
        query, key, value, kv_cache, metadata = zero_batch(case)
        rotary = rope_cos_sin(metadata, case.head_dim) if case.rotary else None
        keys.clear()
        triton_backend.TritonAttentionBackend(case.num_kv_splits).forward(
            query, key, value, kv_cache, metadata, case.head_dim**-0.5, rotary=rotary)
        assert keys, case.id
        assert keys <= warmed, f"{case.id} launches variants the warm-up did not: {keys - warmed}"
