"""Batch-invariant greedy output for quantized CPU models: a row's arithmetic is chosen by
what its request is doing, never by how many rows share the step.

The per-row-count plan (cpu_plan.py) runs decode batches of up to a few rows on the
quantized kernels and larger inputs on dense copies (bf16 on AMX CPUs): the same request's
logits then differ in the low bits with the number of streams beside it, and greedy picks
at near-ties flip (the LM head, int8 against bf16, differs by ~1e-3). Batch-invariant:

* Linears: rows of a decode step (a sequence whose scheduled tokens are all past its prompt:
  one new token, or a verify step's drafts) always take the quantized kernel, whose every row
  meets the same operations at any row count (kvserve.ops.cpu); prompt rows always take the
  dense copy. A step mixing both splits at the runs of rows `routed_rows` names.
* The LM head (its rows are the sampled positions, one a request) always takes the int8 kernel.

* Each prompt's rows take the dense copy in a call of their own (oneDNN's result for a row
  changes in the last bits with the number of rows of its call).

A prompt is computed in the same pieces whatever else runs: the scheduler cuts it only at
canonical chunk boundaries, and prefix hits skip only whole chunks computed as such
(core/sched/canonical_chunks.py). Left to chance: a preempted sequence, whose generated
tokens are recomputed as prompt rows (docs/batch-invariance.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from typing import NamedTuple

from torch import nn


class RowRun(NamedTuple):
    """Rows [start, end) of a step's flattened batch, and whether they are decode rows."""

    start: int
    end: int
    decode: bool


_ROUTED: ContextVar[tuple[RowRun, ...] | None] = ContextVar("kvserve_routed_rows", default=None)


def row_runs(segments: Sequence[tuple[int, bool]]) -> tuple[RowRun, ...]:
    """Each sequence's (row count, decode) segment as a run, consecutive decode segments
    merged. Prompt segments stay one a run: oneDNN's result for a row changes with the
    number of rows of its call, so a prompt's rows are computed in a call of their own,
    whatever other prompts share the step."""
    runs: list[RowRun] = []
    start = 0
    for count, decode in segments:
        if count == 0:
            continue
        if decode and runs and runs[-1].decode:
            runs[-1] = RowRun(runs[-1].start, start + count, decode)
        else:
            runs.append(RowRun(start, start + count, decode))
        start += count
    return tuple(runs)


@contextlib.contextmanager
def routed_rows(runs: tuple[RowRun, ...]) -> Iterator[None]:
    """Within it, batch-invariant layers route the rows of inputs of the runs' total size by
    run (the model's body; the LM head, which sees only the sampled rows, is not routed)."""
    token = _ROUTED.set(runs)
    try:
        yield
    finally:
        _ROUTED.reset(token)


def current_runs(num_rows: int) -> tuple[RowRun, ...] | None:
    """The step's runs when they describe an input of `num_rows` rows, else None."""
    runs = _ROUTED.get()
    return runs if runs and runs[-1].end == num_rows else None


def make_batch_invariant(model: nn.Module) -> int:
    """Turn on batch-invariant routing in every quantized layer of `model` (and its int8 LM
    head copy); returns how many layers it applies to."""
    from kvserve.quantization.base import QuantizedLinear

    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    head = getattr(model, "quantized_lm_head", None)
    if isinstance(head, QuantizedLinear) and head not in layers:
        layers.append(head)
    for layer in layers:
        layer.batch_invariant = True
    return len(layers)
