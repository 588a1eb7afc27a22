"""Whether a persistent kernel with grid barriers keeps the DRAM busier across a layer's
linears than one kernel a linear does: plain streaming reads of llama3-8b's fp8 linears'
bytes (a byte a weight plus an fp32 scale a row), 32 layers in one CUDA graph, read

* apart: one kernel a linear, launched one after another;
* apart, PDL: the same kernels as PDL dependents, each loading its first block before its
  `gdc_wait` (what kvserve's one-row GEMVs do);
* persistent: one kernel a layer that reads the linears in phases, in the order a fused
  decode layer would (o_proj, gate/up, down, the next layer's qkv), with a grid barrier
  between phases; "prefetch" loads each phase's first block before the barrier;
* one read: one kernel a layer, no barriers (the eighteenth session's bound).

Only the barriers' and the kernels' boundaries' costs differ: no arithmetic, no inputs.

    python benchmarks/gpu_persistent_read_bound.py
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_one_row_configs import LAYERS, SHAPES, graph_us

ORDER = ("o", "gate_up", "down", "qkv")
FP8_BYTES = {name: n * k + 4 * n for name, (n, k) in SHAPES.items()}


@triton.jit
def _read_run(base, words, acc, first, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """XOR-reduce a program's run of `words` int32 words at `base`; its first block is `first`."""
    acc ^= first
    for start in tl.range(BLOCK, words, BLOCK, num_stages=STAGES):
        acc ^= tl.load(base + start + tl.arange(0, BLOCK), eviction_policy="evict_first")
    return acc


@triton.jit
def _plain_kernel(ptr, out_ptr, words, BLOCK: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    base = ptr + tl.program_id(0).to(tl.int64) * words
    first = tl.load(base + tl.arange(0, BLOCK), eviction_policy="evict_first")
    if PDL:
        tl.extra.cuda.gdc_wait()
    acc = _read_run(base, words, tl.zeros((BLOCK,), dtype=tl.int32), first, BLOCK, STAGES)
    tl.store(out_ptr + tl.program_id(0) * BLOCK + tl.arange(0, BLOCK), acc)


@triton.jit
def _load_acquire(ptr):
    return tl.inline_asm_elementwise("ld.global.acquire.gpu.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _grid_barrier(counter_ptr, target):
    """Every program of the grid arrives here before any leaves: the program's threads sync,
    one makes a release increment, and every thread spins on acquire loads until all
    programs have arrived (the CUDA grid-sync pattern)."""
    tl.debug_barrier()
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
    while _load_acquire(counter_ptr) < target:
        pass


@triton.jit
def _persistent_kernel(p0, p1, p2, p3, w0, w1, w2, w3, out_ptr, counter_ptr,
                       BLOCK: tl.constexpr, STAGES: tl.constexpr, BARRIERS: tl.constexpr,
                       PREFETCH: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    grid = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    first = tl.load(p0 + pid * w0 + offs, eviction_policy="evict_first")
    acc = _read_run(p0 + pid * w0, w0, acc, first, BLOCK, STAGES)
    for phase in tl.static_range(1, 4):
        ptr = (p0, p1, p2, p3)[phase]
        words = (w0, w1, w2, w3)[phase]
        base = ptr + pid * words
        if PREFETCH:
            first = tl.load(base + offs, eviction_policy="evict_first")
        if BARRIERS:
            _grid_barrier(counter_ptr, grid * phase)
        if not PREFETCH:
            first = tl.load(base + offs, eviction_policy="evict_first")
        acc = _read_run(base, words, acc, first, BLOCK, STAGES)
    tl.store(out_ptr + pid * BLOCK + offs, acc)


def words_per_program(nbytes: int, programs: int, block: int) -> int:
    return -(-nbytes // 4 // programs // block) * block


def main() -> None:
    print(torch.cuda.get_device_name(), "fp8 linears' bytes, 32 layers a graph, ms a step", flush=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    real = LAYERS * sum(FP8_BYTES.values())
    print(f"bytes a step {real / 1e9:.3f} GB ({real / 3.0e9:.3f} ms at 3.0 TB/s)", flush=True)
    results = []
    for programs in (sms, 2 * sms, 4 * sms):
        for block, warps in ((1024, 4), (2048, 8)):
            if programs * warps > sms * 32:
                continue
            words = {name: words_per_program(FP8_BYTES[name], programs, block) for name in ORDER}
            layers = [{name: torch.randint(0, 2**31 - 1, (programs * words[name],), dtype=torch.int32,
                                           device="cuda") for name in ORDER} for _ in range(LAYERS)]
            whole = [torch.randint(0, 2**31 - 1, (programs * sum(words.values()),), dtype=torch.int32,
                                   device="cuda") for _ in range(LAYERS)]
            out = torch.empty(programs * block, dtype=torch.int32, device="cuda")
            counters = torch.zeros(LAYERS, dtype=torch.int32, device="cuda")
            read = LAYERS * programs * 4 * sum(words.values())
            for stages in (3, 4):
                how = f"{programs} programs, {block} words, {warps} warps, {stages} stages"

                def apart(pdl: bool) -> list:
                    return [lambda b=layer[name], w=words[name]: _plain_kernel[(programs,)](
                        b, out, w, BLOCK=block, STAGES=stages, PDL=pdl, num_warps=warps, num_stages=stages,
                        **({"launch_pdl": True} if pdl else {}))
                        for layer in layers for name in ORDER]

                def persistent(barriers: bool, prefetch: bool) -> list:
                    calls = [counters.zero_] if barriers else []
                    return calls + [lambda layer=layer, c=counters[i:]: _persistent_kernel[(programs,)](
                        *(layer[name] for name in ORDER), *(words[name] for name in ORDER), out, c,
                        BLOCK=block, STAGES=stages, BARRIERS=barriers, PREFETCH=prefetch, num_warps=warps,
                        num_stages=stages) for i, layer in enumerate(layers)]

                variants = {
                    "apart": apart(False),
                    "apart, PDL": apart(True),
                    "persistent, barriers": persistent(True, False),
                    "persistent, barriers, prefetch": persistent(True, True),
                    "one read": [lambda b=b: _plain_kernel[(programs,)](
                        b, out, sum(words.values()), BLOCK=block, STAGES=stages, PDL=False, num_warps=warps,
                        num_stages=stages) for b in whole],
                }
                for name, calls in variants.items():
                    ms = graph_us(calls) * len(calls) / 1e3
                    results.append((name, ms, how))
                    print(f"{name:32s} {ms:6.3f} ms ({read / ms / 1e9:.2f} TB/s of {read / 1e9:.2f} GB); {how}",
                          flush=True)
            del layers, whole
            torch.cuda.empty_cache()
    print("best of each:")
    for name in dict.fromkeys(r[0] for r in results):
        ms, how = min((r[1], r[2]) for r in results if r[0] == name)
        print(f"  {name:32s} {ms:6.3f} ms; {how}")


if __name__ == "__main__":
    main()
