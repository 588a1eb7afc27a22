"""Sparse mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE): each token runs through the
top-k of the layer's expert MLPs that its router picks."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvserve import envs
from kvserve.distributed.parallel_state import GroupCoordinator
from kvserve.model_executor.layers.linear import Linear, linear
from kvserve.model_executor.layers.mlp import GatedMLP
from kvserve.ops.expert_weights import ExpertWeights
from kvserve.ops.pending_norm import PendingNorm
from kvserve.quantization.base import QuantizedLinear


class Router(nn.Module):
    """A gate's [outputs, hidden] weight, not a Linear: quantizing it would move which
    experts a token picks, so the quantization methods, which swap Linears, leave it alone."""

    def __init__(self, hidden_size: int, outputs: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(outputs, hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def _grouped(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, num_experts: int,
             run_expert: Callable[[int, torch.Tensor], torch.Tensor | None]) -> torch.Tensor:
    """sum over each token's choices of weight x run_expert(expert, its rows of x): one call
    per expert some token chose, on all of its tokens at once (None: not this rank's)."""
    top_k = chosen.shape[1]
    # (token, slot) pairs grouped by expert, tokens ascending within each: the counts are
    # the layer's one read on the host (a torch.where per expert would be one each).
    order = torch.argsort(chosen.flatten(), stable=True)
    counts = torch.bincount(chosen.flatten(), minlength=num_experts).tolist()
    tokens, weights = order // top_k, weights.flatten()[order]
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            rows = tokens[start : start + count]
            y = run_expert(expert, x[rows])
            if y is not None:
                out.index_add_(0, rows, (y * weights[start : start + count, None]).to(out.dtype))
        start += count
    return out


@torch.library.custom_op("kvserve_moe::grouped_experts", mutates_args=())
def grouped_experts(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor,
                    w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The experts of a packed layer on CPU (`_grouped` over w13 [E, 2I, H] and w2 [E, H, I]),
    as one op that torch.compile leaves opaque: its host read of the routing stays inside, so
    the compiled decode step holds a mixture of experts like any other layer."""
    def run_expert(expert: int, rows: torch.Tensor) -> torch.Tensor:
        gate, up = linear(rows, w13[expert]).chunk(2, dim=-1)
        return linear(F.silu(gate) * up, w2[expert])

    return _grouped(x, chosen, weights, w13.shape[0], run_expert)


@grouped_experts.register_fake
def _(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
      w2: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _stack_dense(linears: list[Linear]) -> ExpertWeights:
    stacked = torch.stack([layer.weight for layer in linears])
    for index, layer in enumerate(linears):
        layer.weight = nn.Parameter(stacked[index], requires_grad=False)
    return ExpertWeights(stacked)


def _stack_quantized(linears: list[QuantizedLinear]) -> ExpertWeights | None:
    """The experts' kernel weights stacked, or None where the experts differ in format (or
    have no kernel form). Each expert's buffers become views of the stacks."""
    kernel_weights = [layer.kernel_weight(layer.qweight.device) for layer in linears]
    first = kernel_weights[0]
    if first is None or any(
            w is None or w.group_size != first.group_size or w.four_bit != first.four_bit
            or w.qweight.dtype != first.qweight.dtype or w.qweight.shape != first.qweight.shape
            or w.scale.dtype != first.scale.dtype or (w.offset is None) != (first.offset is None)
            for w in kernel_weights):
        return None
    parts = [[w.qweight for w in kernel_weights], [w.scale for w in kernel_weights]]
    if first.offset is not None:
        parts.append([w.offset for w in kernel_weights])
    stacks = [torch.stack(tensors) for tensors in parts]
    for index, layer in enumerate(linears):
        for tensors, stack in zip(parts, stacks):
            _replace_buffer_viewed_by(layer, tensors[index], stack[index])
    return ExpertWeights(stacks[0], stacks[1], stacks[2] if len(stacks) == 3 else None,
                         first.group_size, first.four_bit)


def _replace_buffer_viewed_by(module: nn.Module, view: torch.Tensor, replacement: torch.Tensor) -> None:
    """The module's buffer that `view` (a kernel weight's tensor) reads, replaced by the same
    values in `replacement`, shaped as the buffer was."""
    for name, buffer in module.named_buffers(recurse=False):
        if buffer.data_ptr() == view.data_ptr() and buffer.numel() == view.numel():
            setattr(module, name, replacement.view(buffer.shape))
            return
    raise ValueError(f"{type(module).__name__} has no buffer behind its kernel weight")


class SparseMoE(nn.Module):
    """Token choice: a softmax over all experts' router logits in fp32, the top_k kept (and,
    with renormalize, scaled to sum to one), the token's output the sum of its chosen
    experts' outputs weighted by them; Qwen2-MoE adds a shared expert, weighted by the
    sigmoid of its own gate, that every token runs. Each expert is a GatedMLP (plain linears,
    so weight-only quantization, sharding and checkpoint loading treat them like any).

    Once loaded, `pack_experts` stacks the experts' weights into two [E, ...] stacks (the
    experts' tensors become views of them): on CUDA the fused kernels (ops/fused_moe.py)
    route and run them, dense or weight-only quantized, without a host read, so CUDA graphs
    capture the layer; on CPU one opaque op runs dense ones, so the compiled decode step
    covers the rest of the model. Experts that stay unpacked (quantized on CPU, or expert
    parallel) run one after another, eagerly, with the routing read on the host; expert
    parallel layers sum every rank's part with an all-reduce or exchange the tokens with
    all_to_all (use_all_to_all picks).

    At decode batches on CUDA the layer takes part in the RMSNorms around it (PendingNorm):
    it finishes the one before it (folds_pending_norm: the routing kernel and the gate/up GEMV
    scale their products by each row's norm factor) and leaves the one after it pending
    (add_norm_matmul: the combine adds to the residual stream and keeps the norm's sums), so
    a decode layer runs no add+RMSNorm kernel of its own."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 renormalize: bool, shared_intermediate_size: int = 0) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, {num_experts}], got {top_k}")
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = Router(hidden_size, num_experts)
        self.experts = nn.ModuleList(GatedMLP(hidden_size, intermediate_size) for _ in range(num_experts))
        if shared_intermediate_size:
            self.shared_expert = GatedMLP(hidden_size, shared_intermediate_size)
            self.shared_expert_gate = Router(hidden_size, 1)
        # Set by set_parallel: this rank computes a part of every token's output (a share of
        # each expert's rows, or whole experts of its own, the others None), and the parts
        # are summed over the group; or (expert parallel, where use_all_to_all says) the
        # tokens travel to their experts' ranks and back.
        self.tp_group: GroupCoordinator | None = None
        self.expert_parallel = False
        # Set by pack_experts: every expert's stacked weights (not registered: the experts'
        # own parameters and buffers, views of these, are what loaders and state dicts name).
        self.w13: ExpertWeights | None = None
        self.w2: ExpertWeights | None = None

    def set_parallel(self, group: GroupCoordinator, expert_parallel: bool) -> None:
        """Run as one of `group`'s ranks, holding a share of every expert's rows or (expert
        parallel) the contiguous 1/N of the experts numbered rank x E/N onwards."""
        self.tp_group = group
        self.expert_parallel = expert_parallel
        use_all_to_all(group.world_size, self.top_k, False, 0)  # a bad KVSERVE_EP_DISPATCH fails here

    @property
    def packed(self) -> bool:
        return self.w13 is not None

    @torch.no_grad()
    def pack_experts(self) -> bool:
        """Stack the experts' weights into w13 [E, 2I, H] and w2 [E, H, I], the experts' own
        tensors left as views of them (no second copy): dense bias-free linears of one dtype
        and device, or on CUDA, weight-only quantized ones of one format (the fused kernels
        dequantize them). All experts present; returns whether it packed."""
        if self.w13 is not None:
            return True
        if any(e is None or e.gate_up_proj.bias is not None or e.down_proj.bias is not None for e in self.experts):
            return False
        gate_up = [e.gate_up_proj for e in self.experts]
        down = [e.down_proj for e in self.experts]
        if all(type(layer) is Linear for layer in gate_up + down):
            self.w13, self.w2 = _stack_dense(gate_up), _stack_dense(down)
        elif all(isinstance(layer, QuantizedLinear) and layer.qweight.is_cuda for layer in gate_up + down):
            w13, w2 = _stack_quantized(gate_up), _stack_quantized(down)
            if w13 is None or w2 is None:
                return False
            self.w13, self.w2 = w13, w2
        return self.w13 is not None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(chosen [T, top_k] expert ids, their weights [T, top_k] fp32, the shared expert's
        gate [T, 1] or None). On CUDA one kernel (ops/moe_routing.py), exactly equal logits
        going to the lower expert index (as torch.topk on CUDA picks them), which at decode
        batch sizes computes the router's logits too; elsewhere torch's softmax and top-k
        (CPU's breaks such ties otherwise)."""
        shared = hasattr(self, "shared_expert")
        if x.is_cuda:
            from kvserve.ops.moe_routing import FUSED_GATE_MAX_TOKENS, route, route_hidden

            gates = [self.gate.weight] + ([self.shared_expert_gate.weight] if shared else [])
            if (x.dim() == 2 and x.shape[0] <= FUSED_GATE_MAX_TOKENS and x.stride(1) == 1
                    and all(w.dtype == x.dtype and w.stride(1) == 1 for w in gates)):
                return route_hidden(x, self.gate.weight, self.top_k, self.renormalize,
                                    self.shared_expert_gate.weight if shared else None)
        logits = self.gate(x)
        shared_logits = self.shared_expert_gate(x) if shared else None
        if x.is_cuda:
            return route(logits, self.top_k, self.renormalize, shared_logits)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return chosen, weights, None if shared_logits is None else torch.sigmoid(shared_logits)

    def folds_pending_norm(self, rows: int, dtype: torch.dtype) -> bool:
        """Whether forward finishes a PendingNorm of `rows` rows in `dtype` inside its kernels
        (RMSNorm.add_after leaves the norm before the layer pending only then): packed
        experts on CUDA, one rank, no shared expert, routed by route_hidden (the logits
        scaled) and run by the pair GEMVs (gate/up's products scaled before the SwiGLU)."""
        return self.w13 is not None and self.w13.weight.is_cuda and self._fused_kernels_take(rows, dtype)

    def _fused_kernels_take(self, rows: int, dtype: torch.dtype) -> bool:
        """folds_pending_norm's conditions on the packed layer, but its device."""
        from kvserve.ops.fused_moe_gemv import uses_gemv
        from kvserve.ops.moe_routing import FUSED_GATE_MAX_TOKENS

        return (self.tp_group is None and not hasattr(self, "shared_expert") and dtype in (torch.bfloat16, torch.float16)
                and self.gate.weight.dtype == dtype and self.gate.weight.stride(1) == 1
                and 1 <= rows <= FUSED_GATE_MAX_TOKENS
                and uses_gemv(rows * self.top_k, len(self.experts), self.top_k, self.w13.scale is not None))

    def forward(self, x: torch.Tensor | PendingNorm) -> torch.Tensor:
        if isinstance(x, PendingNorm):
            if self.folds_pending_norm(x.rows.shape[0], x.rows.dtype):
                return self._finish_and_run(x)
            x = x.finish()  # from a producer that did not ask folds_pending_norm
        chosen, weights, shared_gate = self.route(x)
        if self.expert_parallel and use_all_to_all(self.tp_group.world_size, self.top_k,
                                                   hasattr(self, "shared_expert"), x.shape[0]):
            return self._exchange(x, chosen, weights)
        if self.w13 is not None and x.is_cuda:
            from kvserve.ops.fused_moe import fused_experts

            out = fused_experts(x, chosen, weights, self.w13, self.w2)
        elif self.w13 is not None:
            out = torch.ops.kvserve_moe.grouped_experts(x, chosen, weights, self.w13.weight, self.w2.weight)
        else:
            out = _grouped(x, chosen, weights, len(self.experts), self._run_unpacked)
        if hasattr(self, "shared_expert"):
            out += shared_gate * self.shared_expert.output(x)
        return out if self.tp_group is None else self.tp_group.all_reduce(out)

    def add_norm_matmul(
        self, x: torch.Tensor | PendingNorm, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float
    ) -> PendingNorm | None:
        """RMSNorm.add_after's fused form: the layer's output added to residual in place by its
        last kernel (the combine, or the summed down GEMV), the norm after it left pending;
        None (nothing done) where the layer would not run x on the kernels folds_pending_norm
        names, or residual is not x's rows contiguous in their dtype, or the norm's weight not
        [H] in it. x may be a PendingNorm (the routing and gate/up finish it)."""
        from kvserve.ops.fused_moe_gemv import experts_gemv_add_norm
        from kvserve.ops.moe_routing import route_hidden

        rows = x.rows if isinstance(x, PendingNorm) else x
        if (rows.dim() != 2 or not self.folds_pending_norm(rows.shape[0], rows.dtype)
                or residual.shape != rows.shape or residual.dtype != rows.dtype or not residual.is_contiguous()
                or norm_weight.shape != rows.shape[1:] or norm_weight.dtype != rows.dtype or rows.stride(1) != 1):
            return None
        chosen, weights, _ = route_hidden(x, self.gate.weight, self.top_k, self.renormalize)
        return PendingNorm(*experts_gemv_add_norm(x, chosen, weights, self.w13, self.w2, residual, norm_weight), eps)

    def _finish_and_run(self, x: PendingNorm) -> torch.Tensor:
        """forward's path for a PendingNorm that folds_pending_norm takes: the routing
        kernel and the gate/up GEMV each scale their products by the norm's factor."""
        from kvserve.ops.fused_moe_gemv import experts_gemv
        from kvserve.ops.moe_routing import route_hidden

        chosen, weights, _ = route_hidden(x, self.gate.weight, self.top_k, self.renormalize)
        return experts_gemv(x, chosen, weights, self.w13, self.w2)

    def _run_unpacked(self, expert: int, rows: torch.Tensor) -> torch.Tensor | None:
        module = self.experts[expert]
        return None if module is None else module.output(rows)

    def _exchange(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Expert parallel by all_to_all. Tensor-parallel attention leaves every rank the same
        tokens, so each rank sends out only its own contiguous 1/N of them (routing every
        token everywhere would send and compute each pair N times): its (token, choice) rows,
        ordered by expert (so by owning rank), go to the experts' ranks after the counts per
        expert do; each rank runs its experts on what arrived, from every rank at once, and
        sends the outputs back; the source weights each token's choices and sums them in
        choice order, and an all_gather gives every rank every token's output again."""
        group, num_experts, top_k = self.tp_group, len(self.experts), self.top_k
        ranks, rank, hidden = group.world_size, group.rank_in_group, x.shape[1]
        per_rank, tokens = num_experts // ranks, x.shape[0]
        chunk = -(-tokens // ranks)
        start, stop = min(rank * chunk, tokens), min((rank + 1) * chunk, tokens)
        ours = chosen[start:stop].flatten().long()  # the CUDA routing kernel's ids are int32
        order = torch.argsort(ours, stable=True)  # pairs by expert, tokens ascending within each
        counts = torch.bincount(ours, minlength=num_experts)
        arriving = group.all_to_all_single(counts).view(ranks, per_rank)  # [source rank, our expert]
        sizes = torch.cat([counts.view(ranks, per_rank).sum(1), arriving.sum(1), arriving.sum(0)]).tolist()
        sent, received, per_expert = sizes[:ranks], sizes[ranks : 2 * ranks], sizes[2 * ranks :]
        rows = group.all_to_all_single(x[start:stop][order // top_k], received, sent)
        # The rows arrive by source rank, then expert: each of our experts runs once on its
        # rows from every rank, and its outputs go where its rows arrived.
        local = torch.arange(per_rank, device=x.device).repeat(ranks).repeat_interleave(
            arriving.flatten(), output_size=rows.shape[0])
        by_expert = torch.argsort(local, stable=True)
        outputs = torch.empty_like(rows)
        first = 0
        for index, count in enumerate(per_expert):
            if count:
                places = by_expert[first : first + count]
                outputs[places] = self.experts[rank * per_rank + index].output(rows[places])
            first += count
        returned = group.all_to_all_single(outputs, sent, received)
        pairs = torch.empty_like(returned)
        pairs[order] = returned
        pairs = pairs.view(stop - start, top_k, hidden).float() * weights[start:stop, :, None]
        ours_out = pairs.sum(dim=1).to(x.dtype)
        if hasattr(self, "shared_expert"):  # its rows are split: its output is summed anyway
            out = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert.output(x)
            out[start:stop] += ours_out
            return group.all_reduce(out)
        padded = x.new_zeros(chunk, hidden)
        padded[: stop - start] = ours_out
        return group.all_gather(padded, dim=0)[:tokens]


def use_all_to_all(ranks: int, top_k: int, shared_expert: bool, tokens: int) -> bool:
    """Whether an expert-parallel layer exchanges a step's tokens by all_to_all
    (SparseMoE._exchange) rather than summing every rank's part of every token's output with
    an all-reduce: where it sends fewer bytes, unless KVSERVE_EP_DISPATCH names one (every
    rank of a group holds the same tokens, so all decide alike). For T tokens over N ranks,
    in hidden-state rows, a ring all-reduce sends 2 (N-1)/N T a rank; the exchange sends a
    rank's C = ceil(T/N) tokens' top_k rows (those for other ranks: (N-1)/N of them with
    even routing) there and back, then all_gathers the C-row slices: (N-1) C (1 + 2 top_k/N).
    Fewer where C (2 top_k + N) < 2 T: never on 2 ranks with top 2 (3/2 of the bytes), on 8
    from 7 tokens (3/4 of them for many). Latency (four collectives and a host read of the
    counts against one collective) is not weighed. A shared expert's split rows need the
    all-reduce anyway, which then carries the experts' parts too."""
    choice = envs.KVSERVE_EP_DISPATCH
    if choice not in ("auto", "all_to_all", "all_reduce"):
        raise ValueError(f"KVSERVE_EP_DISPATCH={choice!r}: expected auto, all_to_all or all_reduce")
    if choice != "auto":
        return choice == "all_to_all"
    return not shared_expert and -(-tokens // ranks) * (2 * top_k + ranks) < 2 * tokens
