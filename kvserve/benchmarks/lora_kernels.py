"""Device time of the LoRA kernels on a named model shape's LoRA linears (q/k/v, o, gate/up,
down), per step size: a few layers' base GEMMs alone, then each followed by the per-token
(BGMV-style) or the grouped (SGMV-style, with the step's grouping of tokens by slot) LoRA
kernels, replayed in a CUDA graph. Says what LoRA adds to the linears' time and from which
step size the grouped kernels win (KVSERVE_LORA_SGMV_MIN_TOKENS). GPU only:

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


def measure(linears: list[Linear], num_tokens: int, num_slots: int, rank: int, dtype: torch.dtype,
            num_layers: int) -> dict[str, float]:
    """Microseconds of `num_layers` layers' base GEMMs alone, then each followed by its
    per-token or grouped LoRA kernels, for num_tokens tokens spread evenly over the slots
    and the base model. Every layer has its own weights and matrices, so that (as in a
    model's step) the LoRA kernels read theirs from HBM, not from L2."""
    layers = [LoRALayerBuffers(linear, num_tokens, num_slots, rank, dtype)
              for _ in range(num_layers) for linear in linears]
    slots = (torch.arange(num_tokens, device="cuda") % (num_slots + 1) - 1).to(torch.int32)
    slots = slots[torch.randperm(num_tokens, device="cuda")].contiguous()

    def base() -> None:
        for layer in layers:
            layer.base()

    def per_token() -> None:
        for layer in layers:
            layer.base()
            layer.per_token(slots)

    def grouped() -> None:
        groups = align_by_slot(slots, num_tokens, num_slots)  # once a forward pass
        for layer in layers:
            layer.base()
            layer.grouped(groups)

    return {"base": cuda_graph_time_us(base), "per_token": cuda_graph_time_us(per_token),
            "grouped": cuda_graph_time_us(grouped)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-shape", default="llama3-8b", help="named model shape whose linears are measured")
    parser.add_argument("--num-slots", type=int, default=8, help="adapter slots (tokens spread over them and the base)")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank of every slot")
    parser.add_argument("--tokens", default="1,8,16,32,64,128,256,512,2048", help="comma-separated step sizes")
    parser.add_argument("--dtype", default="bfloat16", help="torch dtype of activations and matrices")
    parser.add_argument("--layers", type=int, default=8, help="layers a step, each with its own weights")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    linears = shape_linears(args.model_shape)
    print(f"{args.model_shape} LoRA linears ({linears}) x {args.layers} layers, {args.num_slots} slots of rank "
          f"{args.rank}, {args.dtype}; CUDA-graph device time of the base GEMMs alone and followed by LoRA kernels")
    print(f"{'tokens':>7s} {'base us':>9s} {'+per-token us':>14s} {'+grouped us':>12s} {'per-token x':>12s} "
          f"{'grouped x':>10s}")
    for num_tokens in (int(t) for t in args.tokens.split(",")):
        times = measure(linears, num_tokens, args.num_slots, args.rank, dtype, args.layers)
        print(f"{num_tokens:7d} {times['base']:9.1f} {times['per_token']:14.1f} {times['grouped']:12.1f} "
              f"{times['per_token'] / times['base']:12.3f} {times['grouped'] / times['base']:10.3f}")


if __name__ == "__main__":
    main()
