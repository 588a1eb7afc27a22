"""Device time of the LoRA kernels on one layer of a named model shape's LoRA linears
(q/k/v, o, gate/up, down), per step size, beside the base linears' own GEMMs: the
per-token (BGMV-style) kernels and the grouped (SGMV-style) ones with the step's grouping
of tokens by slot, each replayed in a CUDA graph. Says what a LoRA step costs over the base
model and from which step size the grouped kernels win (KVSERVE_LORA_SGMV_MIN_TOKENS). GPU only:

    python -m kvserve.benchmarks.lora_kernels [--model-shape llama3-8b] [--num-slots 8]
        [--rank 16] [--tokens 1,16,...]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from kvserve.ops.lora import MAX_SLICES, align_by_slot, lora_expand_slices, lora_shrink, sgmv_expand, sgmv_shrink

# A LoRA linear: (input features, output slice sizes).
Linear = tuple[int, tuple[int, ...]]


def shape_linears(model_shape: str) -> list[Linear]:
    """qkv_proj, o_proj, gate_up_proj and down_proj of a named model shape."""
    from kvserve.model_executor.dummy import dummy_model_config

    config = dummy_model_config(model_shape)
    hidden, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    head_dim = config.head_dim
    inter = config.intermediate_size
    return [(hidden, (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)), (heads * head_dim, (hidden,)),
            (hidden, (inter, inter)), (inter, (hidden,))]


class LoRALayerBuffers:
    """Random A [slots, slices x rank, in] and each slice's B [out, slots x rank] of one
    linear, with its step input x, output y and base weight."""

    def __init__(self, linear: Linear, num_tokens: int, num_slots: int, rank: int, dtype: torch.dtype) -> None:
        in_features, self.sizes = linear
        self.rank = rank
        self.lora_a = torch.randn(num_slots, len(self.sizes) * rank, in_features, dtype=dtype, device="cuda") * 0.01
        self.lora_bs = [torch.randn(size, num_slots * rank, dtype=dtype, device="cuda") * 0.01 for size in self.sizes]
        self.weight = torch.randn(sum(self.sizes), in_features, dtype=dtype, device="cuda") * 0.01
        self.x = torch.randn(num_tokens, in_features, dtype=dtype, device="cuda")
        self.y = torch.zeros(num_tokens, sum(self.sizes), dtype=dtype, device="cuda")

    def base(self) -> None:
        torch.mm(self.x, self.weight.t(), out=self.y)

    def per_token(self, slots: torch.Tensor) -> None:
        assert len(self.sizes) <= MAX_SLICES
        lora_expand_slices(lora_shrink(self.x, self.lora_a, slots), self.lora_bs, self.rank, slots, self.y)

    def grouped(self, groups) -> None:
        sgmv_expand(sgmv_shrink(self.x, self.lora_a, groups), self.lora_bs, self.rank, groups, self.y)


def cuda_graph_time_us(fn: Callable[[], None]) -> float:
    import triton.testing

    fn()  # compiles outside the capture
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn) * 1e3


def measure(linears: list[Linear], num_tokens: int, num_slots: int, rank: int,
            dtype: torch.dtype) -> dict[str, float]:
    """Microseconds of one layer's base GEMMs, per-token and grouped LoRA kernels, for
    num_tokens tokens spread evenly over the slots and the base model."""
    layers = [LoRALayerBuffers(linear, num_tokens, num_slots, rank, dtype) for linear in linears]
    slots = (torch.arange(num_tokens, device="cuda") % (num_slots + 1) - 1).to(torch.int32)
    slots = slots[torch.randperm(num_tokens, device="cuda")].contiguous()

    def grouped() -> None:
        groups = align_by_slot(slots, num_tokens, num_slots)  # once a forward pass
        for layer in layers:
            layer.grouped(groups)

    return {"base": cuda_graph_time_us(lambda: [layer.base() for layer in layers]),
            "per_token": cuda_graph_time_us(lambda: [layer.per_token(slots) for layer in layers]),
            "grouped": cuda_graph_time_us(grouped)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-shape", default="llama3-8b", help="named model shape whose linears are measured")
    parser.add_argument("--num-slots", type=int, default=8, help="adapter slots (tokens spread over them and the base)")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank of every slot")
    parser.add_argument("--tokens", default="1,8,16,32,64,128,256,512,2048", help="comma-separated step sizes")
    parser.add_argument("--dtype", default="bfloat16", help="torch dtype of activations and matrices")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    linears = shape_linears(args.model_shape)
    print(f"{args.model_shape} LoRA linears (one layer: {linears}), {args.num_slots} slots of rank {args.rank}, "
          f"{args.dtype}; CUDA-graph device time")
    print(f"{'tokens':>7s} {'base us':>9s} {'per-token us':>13s} {'grouped us':>11s} {'best/base':>10s}")
    for num_tokens in (int(t) for t in args.tokens.split(",")):
        times = measure(linears, num_tokens, args.num_slots, args.rank, dtype)
        best = min(times["per_token"], times["grouped"])
        print(f"{num_tokens:7d} {times['base']:9.1f} {times['per_token']:13.1f} {times['grouped']:11.1f} "
              f"{best / times['base']:10.2f}")


if __name__ == "__main__":
    main()
