"""A torch.compile'd forward for CPU decode steps (`--compile-decode`).

Eager, a CPU decode step of a small model is bound by dispatching ~30 small torch ops per
layer (norms, rotary, casts around the int4 kernel, the paged-attention gather), not by
the bytes it reads. Inductor fuses those into a few C++ loops per layer; the whole model is
one graph, since per-layer graphs pay ~140 us of Dynamo guards and wrappers each (measured:
SmolLM2 batch-1 step 18.2 eager, 16.6 per-layer graphs, 12.4 ms one graph; the numbers and
what else was tried are in benchmarks/results/cpu_profile.md).

The graph covers steps of up to MAX_ROWS query rows: decodes (one token a sequence) and
speculative verify steps (1 + k tokens, a chain or a token tree), which so cost what a decode
batch of as many rows costs and take the same graph. The attention reads each layer's cached
context through `DecodeContext` (and the step's own new keys/values under its causal or tree
mask) and returns the new keys/values of all layers as one tensor, written into the cache (the
layers' caches are views of one tensor) in one copy after the graph (an in-graph cache write
makes inductor copy the cache). Row count and context length are dynamic; one row gets a graph
of its own (0/1 specialization: traced size-obliviously, inductor still specialized the size-1
batch), and so does each band of row counts on one side of a quantized layer's kernel/dense row
threshold (a guard of the graph): two or three compiles, done at start-up by `warm_up`, or
one at a time by `compile_next` while a server is idle (a step whose band has no graph yet
runs eager). Batch-invariant runners compile them at start-up and send every decode row
through a graph, in groups of up to MAX_ROWS, with any prompt rows of the step in an eager
forward beside it: a row gets the same bits from either graph and any padded context
length, but other low bits from an eager forward.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch
from torch import nn

from kvserve.attention.metadata import AttentionMetadata
from kvserve.attention.torch_ref import (
    FLOAT8_DTYPES,
    DecodeContext,
    TorchReferenceBackend,
    decode_context,
)
from kvserve.ops import cpu as cpu_kernels
from kvserve.quantization.base import CPU_KERNEL_MAX_ROWS, QuantizedLinear

logger = logging.getLogger(__name__)

# Query rows per compiled step: the int4/int8 kernels' range (their dispatch on the row
# count is a guard of the graph, so larger batches would compile again); more run eager.
MAX_ROWS = CPU_KERNEL_MAX_ROWS
# The graphs' shortest cached context (the padded longest of the step): lengths 0 and 1
# would be specialized, compiling again. A step whose longest is 1 is padded to it; steps
# with no cached context (a first prompt chunk) run eager.
MIN_CONTEXT = 2


def _decode_forward(
    model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
    kv_caches: list[torch.Tensor], slots: torch.Tensor, valid: torch.Tensor, new_valid: torch.Tensor,
    stream_layers: tuple[int, ...],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(hidden states, every layer's new keys and values as one [layers, 2, T, ...] tensor,
    the residual streams entering `stream_layers` side by side [T, layers x H] or None)."""
    context = DecodeContext(slots, valid, new_valid)
    streams = dict.fromkeys(stream_layers) if stream_layers else None
    hidden = model(input_ids, positions, kv_caches, context, residual_streams=streams)
    # [layers, 2, T, kv_heads, head_dim]: written to the cache in one copy after the graph.
    new_kv = torch.stack([torch.stack(key_value) for key_value in context.new_kv]).to(kv_caches[0].dtype)
    return hidden, new_kv, torch.cat([streams[i] for i in stream_layers], dim=-1) if streams else None


def layer_stack(kv_caches: list[torch.Tensor]) -> torch.Tensor | None:
    """The per-layer caches as one [layers, ...] view when they are the consecutive slices of
    one contiguous tensor (as the model runner allocates them on CPU), else None."""
    if not kv_caches:
        return None
    first = kv_caches[0]
    layer_bytes = first.numel() * first.element_size()
    if any(c.shape != first.shape or not c.is_contiguous() or c.data_ptr() != first.data_ptr() + i * layer_bytes
           for i, c in enumerate(kv_caches)):
        return None
    return first.as_strided((len(kv_caches), *first.shape), (first.numel(), *first.stride()))


class CompiledDecode:
    """Runs a CPU model's decode and verify steps through a compiled graph of its forward."""

    def __init__(self, model: nn.Module, kv_caches: list[torch.Tensor], sliding_window: int | None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        stack = layer_stack(kv_caches)
        # [layers, 2, slots, kv_heads, head_dim]: where a step's new keys and values go.
        self._slots_view = None if stack is None else stack.flatten(2, 3)
        self.sliding_window = sliding_window
        # Layers whose entering residual streams every step also returns (EAGLE-3's).
        self.stream_layers: tuple[int, ...] = ()
        # The smallest batch of each graph's band, and of those not compiled yet.
        self._band_starts = self.graph_batch_sizes()
        self._pending = list(self._band_starts)
        self._compile_seconds = 0.0
        # No inductor freezing: it keeps AOT autograd's cache off ("cannot cache a graph with
        # freezing enabled"), so every start traced the graphs again: warm start-up 97 -> 37 s
        # without it, and a batch-1 SmolLM2 step the same within noise (2-core EPYC, 12
        # alternating rounds: 15.3 vs 16.0 ms median, 13.6 vs 13.2 best); on an AMX Xeon
        # freezing gains ~10% of a batch-1 step for ~70 s more at every start (BENCHMARKS.md,
        # "Tried, did not pay").
        # Per-call overhead, measured as one batch-1 SmolLM2 int8 forward (2-core EPYC, two
        # alternating runs each): 16.5 / 13.7 ms as compiled by default, 12.2 / 12.2 without
        # these two checks. Dynamo's guards on the model's attributes protect nothing here:
        # each instance keeps graphs of its own (isolate_recompiles: another model's graphs,
        # e.g. a draft model's, are never looked up) and its model is not changed after
        # start-up; the guards on the inputs' shapes (which pick the batch band's graph) stay.
        # The size asserts re-check, in Python, ~490 input and output layouts a call that
        # those guards and the ops' registered shapes already fix.
        # The kernels' availability is a constant to the graphs (see ops.cpu.available).
        cpu_kernels.available = torch.compiler.assume_constant_result(cpu_kernels.available)
        self._forward = torch.compile(
            _decode_forward, dynamic=False, fullgraph=True, isolate_recompiles=True, options={
                "size_asserts": False, "alignment_asserts": False,
                "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})

    @staticmethod
    def supports(model: nn.Module, kv_caches: list[torch.Tensor], device: torch.device) -> bool:
        """CPU, the torch reference attention (the only one that reads a DecodeContext),
        a cache that stores keys/values as computed (not float8), the layers' caches views of
        one tensor, and a model whose steps a graph can hold (graph_capturable)."""
        backend = model.model.layers[0].self_attn.attn_backend
        return (device.type == "cpu" and isinstance(backend, TorchReferenceBackend)
                and kv_caches[0].dtype not in FLOAT8_DTYPES and layer_stack(kv_caches) is not None
                and model.graph_capturable)

    def applies(self, metadata: AttentionMetadata) -> bool:
        """At most MAX_ROWS query rows (decodes, verify steps, short chunks) after a cached
        context, in a band of row counts whose graph is compiled (a step never waits for a
        compile)."""
        starts = metadata.query_start_loc_cpu
        num_rows = starts[-1]
        if num_rows > MAX_ROWS:
            return False
        num_cached = max(s - (b - a) for s, a, b in zip(metadata.seq_lens_cpu, starts, starts[1:]))
        return (num_cached >= 1
                and self._band_starts[bisect.bisect_right(self._band_starts, num_rows) - 1] not in self._pending)

    @property
    def pending(self) -> int:
        """Graphs not compiled yet."""
        return len(self._pending)

    def keep_streams(self, layers: tuple[int, ...]) -> None:
        """From now on return the residual streams entering `layers` too (forward_with_streams);
        every graph is compiled again, before a step uses it (applies)."""
        if layers != self.stream_layers:
            self.stream_layers = layers
            self._pending = list(self._band_starts)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        return self.forward_with_streams(input_ids, positions, metadata)[0]

    def forward_with_streams(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
                             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden states, the streams of keep_streams' layers side by side or None)."""
        # A context of one position is padded to MIN_CONTEXT (masked), which the graphs take.
        context = decode_context(metadata, self.sliding_window, min_cached=MIN_CONTEXT)
        hidden, new_kv, streams = self._run(input_ids, positions, context)
        self._slots_view.index_copy_(2, metadata.slot_mapping, new_kv)
        return hidden, streams

    def graph_batch_sizes(self) -> list[int]:
        """The smallest row count of each graph: 1, 2, and one past each row threshold at
        which the model's quantized layers switch from their kernel to their dense copy
        (batch-invariant layers have none: their decode rows always take the kernel)."""
        thresholds = {m.cpu_kernel_max_rows for m in self.model.modules()
                      if isinstance(m, QuantizedLinear) and not m.batch_invariant}
        return [1, 2, *sorted(t + 1 for t in thresholds if 2 <= t < MAX_ROWS)]

    def bands(self) -> list[str]:
        """Each graph's row counts, in words."""
        sizes = self._band_starts
        return [f"{a} row" if b == a + 1 else f"{a}-{b - 1} rows" for a, b in zip(sizes, [*sizes[1:], MAX_ROWS + 1])]

    def warm_up(self) -> None:
        """Compile every graph now rather than in the first requests."""
        while self.compile_next():
            pass

    def compile_next(self) -> bool:
        """Compile the next pending graph, in inference mode as the model runner's steps (the
        graphs guard on it); False when none is pending. The new keys and values are not
        written: the cache is left as it was. Dynamo traces each graph at every start (~8 s
        each on 2 cores); inductor's code and AOT autograd's graphs come from their on-disk
        caches after the first start.

        A band compiles at its largest row count, then runs at its smallest: AOT autograd's
        cache hands back a graph cached by another plan (another run's bands: the same ops for
        rows 2-4, say, where this plan's band is 2-16) with that plan's narrower guards, and a
        band compiled at 2 rows then compiled again at its first step of 5, mid-serving (~13 s
        of a 16-stream benchmark's steps on 2 cores). At the largest row count such a graph
        does not match; a run at the smallest compiles now whatever the first graph misses."""
        if not self._pending:
            return False
        sizes, bands = self._band_starts, self.bands()
        index = sizes.index(self._pending[0])
        last = [*sizes[1:], MAX_ROWS + 1][index] - 1
        start = time.perf_counter()
        for num_rows in dict.fromkeys((last, sizes[index])):
            self._run_placeholder(num_rows)
        self._pending.pop(0)
        seconds = time.perf_counter() - start
        self._compile_seconds += seconds
        logger.info("decode graph %d/%d (%s) compiled in %.1f s", index + 1, len(sizes), bands[index], seconds)
        if not self._pending:
            logger.info("compiled the CPU decode step: %d graphs in %.1f s", len(sizes), self._compile_seconds)
        return True

    def _run_placeholder(self, num_rows: int) -> None:
        """A step of `num_rows` rows on zeros, its new keys and values dropped."""
        with torch.inference_mode():
            context = DecodeContext(slots=torch.zeros(num_rows, MIN_CONTEXT, dtype=torch.long),
                                    valid=torch.ones(num_rows, MIN_CONTEXT, dtype=torch.bool),
                                    new_valid=torch.eye(num_rows, dtype=torch.bool))
            self._run(torch.zeros(num_rows, dtype=torch.long),
                      torch.full((num_rows,), MIN_CONTEXT, dtype=torch.long), context)

    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor, context: DecodeContext
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        for tensor, dims in ((input_ids, (0,)), (positions, (0,)), (context.slots, (0, 1)),
                             (context.valid, (0, 1)), (context.new_valid, (0, 1))):
            for dim in dims:
                if tensor.shape[dim] > 1:  # size 1 is specialized whatever is marked
                    torch._dynamo.mark_dynamic(tensor, dim)
        return self._forward(self.model.model, input_ids, positions, self.kv_caches,
                             context.slots, context.valid, context.new_valid, self.stream_layers)
