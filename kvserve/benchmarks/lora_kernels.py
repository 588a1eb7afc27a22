"""Device time of the LoRA kernels on llama3-8b's four LoRA linears (q/k/v, o, gate/up, down)
per step size: the per-token (BGMV-style) kernels against the grouped (SGMV-style) ones with
their grouping of the tokens by slot, each replayed in a CUDA graph, to place the step size
from which LoRA layers take the grouped ones (KVSERVE_LORA_SGMV_MIN_TOKENS). GPU only:

    python -m kvserve.benchmarks.lora_kernels [--num-slots 8] [--rank 16] [--tokens 1,16,...]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from kvserve.ops.lora import align_by_slot, lora_expand_slices, lora_shrink, sgmv_expand, sgmv_shrink

# llama3-8b: (in_features, slice sizes) of qkv_proj, o_proj, gate_up_proj, down_proj.
LLAMA3_8B_LINEARS = [(4096, (4096, 1024, 1024)), (4096, (4096,)), (4096, (14336, 14336)), (14336, (4096,))]


def make_layers(linears: list[tuple[int, tuple[int, ...]]], num_slots: int, rank: int, dtype: torch.dtype,
                device: str) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """Random A [slots, slices x rank, in] and each slice's B [out, slots x rank]."""
    return [(torch.randn(num_slots, len(sizes) * rank, in_features, dtype=dtype, device=device) * 0.01,
             [torch.randn(size, num_slots * rank, dtype=dtype, device=device) * 0.01 for size in sizes])
            for in_features, sizes in linears]


def per_token_step(xs: list[torch.Tensor], ys: list[torch.Tensor], layers, slots: torch.Tensor,
                   rank: int) -> Callable[[], None]:
    def run() -> None:
        for x, y, (lora_a, lora_bs) in zip(xs, ys, layers):
            lora_expand_slices(lora_shrink(x, lora_a, slots), lora_bs, rank, slots, y)
    return run


def grouped_step(xs: list[torch.Tensor], ys: list[torch.Tensor], layers, slots: torch.Tensor,
                 rank: int) -> Callable[[], None]:
    num_slots = layers[0][0].shape[0]

    def run() -> None:
        groups = align_by_slot(slots, xs[0].shape[0], num_slots)  # once a forward pass
        for x, y, (lora_a, lora_bs) in zip(xs, ys, layers):
            sgmv_expand(sgmv_shrink(x, lora_a, groups), lora_bs, rank, groups, y)
    return run


def measure(num_tokens: int, num_slots: int, rank: int, dtype: torch.dtype, device: str,
            time_us: Callable[[Callable[[], None]], float],
            linears: list[tuple[int, tuple[int, ...]]] = LLAMA3_8B_LINEARS) -> tuple[float, float]:
    """(per-token, grouped) time of one pass over `linears` for num_tokens tokens spread
    evenly over the slots and the base model."""
    layers = make_layers(linears, num_slots, rank, dtype, device)
    xs = [torch.randn(num_tokens, in_features, dtype=dtype, device=device) for in_features, _ in linears]
    ys = [torch.zeros(num_tokens, sum(sizes), dtype=dtype, device=device) for _, sizes in linears]
    slots = (torch.arange(num_tokens, device=device) % (num_slots + 1) - 1).to(torch.int32)
    slots = slots[torch.randperm(num_tokens, device=device)]
    return (time_us(per_token_step(xs, ys, layers, slots, rank)),
            time_us(grouped_step(xs, ys, layers, slots, rank)))


def cuda_graph_time_us(fn: Callable[[], None]) -> float:
    import triton.testing

    fn()  # compiles outside the capture
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-slots", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--tokens", default="1,8,16,32,48,64,96,128,256,512,2048,8192")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"llama3-8b LoRA linears (one layer), {args.num_slots} slots of rank {args.rank}, {args.dtype}, "
          f"tokens spread over the slots and the base model; CUDA-graph device time")
    print(f"{'tokens':>7s} {'per-token us':>13s} {'grouped us':>11s} {'grouped/per-token':>18s}")
    for num_tokens in (int(t) for t in args.tokens.split(",")):
        per_token, grouped = measure(num_tokens, args.num_slots, args.rank, dtype, "cuda", cuda_graph_time_us)
        print(f"{num_tokens:7d} {per_token:13.1f} {grouped:11.1f} {grouped / per_token:18.2f}")


if __name__ == "__main__":
    main()
