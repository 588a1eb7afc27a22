"""The front's last stage: the core's per-step deltas turned into RequestOutputs, with
incremental detokenizing and stop strings (which end a sample on its text, so the core
is told to stop it)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.engine.messages import EngineCoreOutputs, EngineCoreRequest
from kvserve.outputs import CompletionOutput, GrowingListPrefix, RequestMetrics, RequestOutput
from kvserve.spec_decode.stats import SpecDecodeStats


@dataclass
class SampleState:
    """One of a request's n samples, as the user sees it."""

    index: int
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    text: str = ""  # handed out so far: a prefix of the final text
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False)
class RequestState:
    request: EngineCoreRequest
    prompt: str | None
    samples: list[SampleState] = field(default_factory=list)
    # One entry per prompt token (None for the first, which has no context).
    prompt_logprobs: list[dict[int, float] | None] | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    spec_stats: SpecDecodeStats | None = None
    finished: bool = False
    error: str | None = None  # why the engine failed it

    @property
    def request_id(self) -> str:
        return self.request.request_id


class OutputProcessor:
    def __init__(self, tokenizer: Any, speculating: bool) -> None:
        self.tokenizer = tokenizer
        self.speculating = speculating
        self.requests: dict[str, RequestState] = {}

    def add_request(self, request: EngineCoreRequest, prompt: str | None) -> RequestState:
        state = RequestState(request, prompt, spec_stats=SpecDecodeStats() if self.speculating else None)
        if request.params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]
        self.requests[request.request_id] = state
        return state

    def _sample(self, state: RequestState, index: int) -> SampleState:
        while len(state.samples) <= index:  # samples a prompt forked into appear together
            detokenizer = None
            if self.tokenizer is not None:
                detokenizer = IncrementalDetokenizer(
                    self.tokenizer, state.request.prompt_token_ids, state.request.params
                )
            state.samples.append(SampleState(len(state.samples), detokenizer))
        return state.samples[index]

    def process(
        self, outputs: EngineCoreOutputs, final_only: bool = False
    ) -> tuple[list[RequestOutput], list[tuple[str, int]]]:
        """(an output for every request that got tokens (only for those that finished,
        with final_only: building outputs costs host time), the samples (request id,
        index) that stop strings ended, for the core to stop)."""
        for request_id, (when, num_cached) in outputs.first_scheduled.items():
            state = self.requests.get(request_id)
            if state is not None:
                state.first_scheduled_time, state.num_cached_tokens = when, num_cached
        for request_id, entries in outputs.prompt_logprobs.items():
            state = self.requests.get(request_id)
            if state is not None:
                state.prompt_logprobs.extend(entries)
        token_time = time.time()
        touched: dict[str, RequestState] = {}
        stops: list[tuple[str, int]] = []
        for delta in outputs.deltas:
            state = self.requests.get(delta.request_id)
            if state is None:
                continue  # aborted here while its step ran
            sample = self._sample(state, delta.index)
            if sample.finished:
                continue  # a stop string ended it while the core ran on
            if delta.num_drafts:
                state.spec_stats.observe(delta.num_drafts, delta.num_accepted)
            if self._append(sample, state, delta.token_ids, delta.logprobs):
                stops.append((delta.request_id, delta.index))
            elif delta.finish_reason is not None:
                sample.finish_reason, sample.stop_reason = delta.finish_reason, delta.stop_reason
            if sample.detokenizer is not None:
                sample.text += sample.detokenizer.take_delta(finished=sample.finished)
            if state.first_token_time is None:
                state.first_token_time = token_time
            touched[delta.request_id] = state
        finished_in_core = set(outputs.finished_requests)
        results = []
        for request_id, state in touched.items():
            samples = state.samples
            if request_id in finished_in_core or (
                len(samples) == state.request.params.n and all(s.finished for s in samples)
            ):
                self._finish(state)
            if state.finished or not final_only:
                results.append(self.make_output(state))
        return results, stops

    @staticmethod
    def _append(
        sample: SampleState, state: RequestState, token_ids: list[int],
        logprobs: list[dict[int, float]] | None,
    ) -> bool:
        """Take the tokens one by one; returns whether a stop string ended the sample (the
        tokens after it are dropped)."""
        for i, token_id in enumerate(token_ids):
            sample.token_ids.append(token_id)
            if logprobs is not None:
                sample.logprobs.append(logprobs[i])
                sample.cumulative_logprob += logprobs[i][token_id]
            if sample.detokenizer is not None:
                stop = sample.detokenizer.add_tokens([token_id])
                if stop is not None:
                    sample.finish_reason, sample.stop_reason = "stop", stop
                    return True
        return False

    def _finish(self, state: RequestState) -> None:
        state.finished = True
        state.finished_time = time.time()
        del self.requests[state.request_id]

    def abort(self, request_id: str, error: str | None = None) -> RequestOutput | None:
        """End a request that is still running: aborted, or failed by the engine (`error`)."""
        state = self.requests.get(request_id)
        if state is None:
            return None
        for sample in state.samples or [self._sample(state, 0)]:
            if not sample.finished:
                sample.finish_reason = "abort" if error is None else "error"
        state.error = error
        self._finish(state)
        return self.make_output(state)

    @staticmethod
    def make_output(state: RequestState) -> RequestOutput:
        request = state.request
        wants_logprobs = request.params.logprobs is not None
        # Finished: lists of its own. Streaming: views of what the sample holds now.
        snapshot = list if state.finished else GrowingListPrefix
        completions = [
            CompletionOutput(
                index=sample.index,
                text=sample.text,
                token_ids=snapshot(sample.token_ids),
                cumulative_logprob=sample.cumulative_logprob if wants_logprobs else None,
                logprobs=snapshot(sample.logprobs) if wants_logprobs else None,
                finish_reason=sample.finish_reason,
                stop_reason=sample.stop_reason,
            )
            for sample in state.samples
        ]
        return RequestOutput(
            request_id=request.request_id,
            prompt=state.prompt,
            prompt_token_ids=request.prompt_token_ids,
            prompt_logprobs=state.prompt_logprobs,
            outputs=completions,
            finished=state.finished,
            metrics=RequestMetrics(
                arrival_time=request.arrival_time, first_scheduled_time=state.first_scheduled_time,
                first_token_time=state.first_token_time, finished_time=state.finished_time,
                spec_decode=state.spec_stats,
            ),
            num_cached_tokens=state.num_cached_tokens,
            error=state.error,
        )
