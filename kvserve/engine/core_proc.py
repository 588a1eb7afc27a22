"""The engine core in a process of its own: it steps while it has work and takes the
front's messages between steps, so tokenizing, detokenizing and building outputs run
beside the model instead of between its steps (vLLM's EngineCoreProc)."""

from __future__ import annotations

import logging
import queue
import threading
import weakref
from multiprocessing.connection import Connection
from typing import Any

from kvserve.engine.engine_args import EngineArgs
from kvserve.engine.messages import EngineCoreInfo, EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from kvserve.logger import configure_logging

logger = logging.getLogger(__name__)

# How long the front waits for a step's outputs before checking that the core still runs.
_LIVENESS_CHECK_S = 1.0


def _merge(first: EngineCoreOutputs, later: EngineCoreOutputs) -> EngineCoreOutputs:
    """Two consecutive steps' outputs as one (the front was slower than the core)."""
    first.deltas += later.deltas
    first.first_scheduled.update(later.first_scheduled)
    for request_id, entries in later.prompt_logprobs.items():
        first.prompt_logprobs.setdefault(request_id, []).extend(entries)
    first.finished_requests += later.finished_requests
    first.failed_requests.update(later.failed_requests)
    first.stats = later.stats
    return first


def run_engine_core(
    args: EngineArgs, inputs: Connection, outputs: Connection, num_threads: int, log_level: int,
) -> None:
    """The core process's main: build the core, then step while there is work, taking
    every queued message between steps; wait for one only when idle. `num_threads`: the
    front's torch threads (its model would have run on them); the core logs as the front
    does, to the same stderr."""
    import torch

    from kvserve.engine.core import EngineCore

    configure_logging(log_level)
    torch.set_num_threads(num_threads)

    try:
        core = EngineCore(args)
    except BaseException as error:  # reported to the front, which raises it
        outputs.send(("error", error if _picklable(error) else RuntimeError(repr(error))))
        return
    outputs.send(("ready", (core.info, core.stats())))
    try:
        _serve(core, inputs, outputs)
    except (EOFError, BrokenPipeError):
        pass  # the front is gone: so is the reason to run


def _serve(core: Any, inputs: Connection, outputs: Connection) -> None:
    core.start_background_work()
    while True:
        idle = not core.has_unfinished_requests()
        if idle or inputs.poll(0):
            handled = _handle(core, inputs.recv(), outputs)
            while handled and inputs.poll(0):
                handled = _handle(core, inputs.recv(), outputs)
            if not handled:
                return
            if not core.has_unfinished_requests():
                outputs.send(("stats", core.stats()))  # e.g. after an abort
            continue
        try:
            outputs.send(("outputs", core.step()))
        except Exception as error:  # the front fails the requests; the core goes on
            logger.exception("engine core step failed")
            outputs.send(("step_error", RuntimeError(f"engine step failed: {error!r}")))


def _handle(core: Any, message: tuple[str, Any], outputs: Connection) -> bool:
    """Apply one message from the front (answering those that ask); False on shutdown."""
    kind, payload = message
    if kind == "add":
        core.add_request(payload)
    elif kind == "abort":
        core.abort_requests(payload)
    elif kind == "stop":
        core.stop_sequences(payload)
    elif kind == "remove_lora":
        core.remove_lora(payload)
    elif kind == "snapshot":
        outputs.send(("snapshot", core.dashboard_snapshot()))
    elif kind == "shutdown":
        return False
    else:
        raise ValueError(f"unknown engine core message {kind!r}")
    return True


def _picklable(value: object) -> bool:
    import pickle

    try:
        pickle.dumps(value)
    except Exception:
        return False
    return True


class MPClient:
    """The front's end of a core process: messages out, a reader thread taking the
    core's outputs as they come."""

    def __init__(self, args: EngineArgs) -> None:
        import multiprocessing

        import torch

        context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        input_reader, self._input = context.Pipe(duplex=False)
        self._output, output_writer = context.Pipe(duplex=False)
        self._process = context.Process(
            target=run_engine_core,
            args=(args, input_reader, output_writer, torch.get_num_threads(), logging.getLogger().level),
            name="kvserve-engine-core", daemon=True,
        )
        self._process.start()
        input_reader.close()
        output_writer.close()
        weakref.finalize(self, _stop, self._process, self._input)
        kind, payload = self._receive_startup()
        if kind == "error":
            self._process.join(timeout=10)
            raise payload
        self.info: EngineCoreInfo
        self._stats: SchedulerStats
        self.info, self._stats = payload
        self._outputs: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._snapshots: queue.SimpleQueue[dict] = queue.SimpleQueue()
        self._pending_error: BaseException | None = None  # met while merging outputs
        self._send_lock = threading.Lock()
        threading.Thread(target=self._read, name="kvserve-core-outputs", daemon=True).start()

    def _receive_startup(self) -> tuple[str, Any]:
        while not self._output.poll(_LIVENESS_CHECK_S):
            if not self._process.is_alive():
                raise RuntimeError(f"the engine core process died while starting (exit code {self._process.exitcode})")
        return self._output.recv()

    def _read(self) -> None:
        while True:
            try:
                kind, payload = self._output.recv()
            except (EOFError, OSError):
                self._outputs.put(("step_error", RuntimeError("the engine core process exited")))
                return
            if kind == "stats":
                self._stats = payload
                continue
            if kind == "snapshot":
                self._snapshots.put(payload)
                continue
            if kind == "outputs":
                self._stats = payload.stats
            self._outputs.put((kind, payload))

    def _send(self, message: tuple[str, Any]) -> None:
        with self._send_lock:
            self._input.send(message)

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(("add", request))

    def abort_requests(self, request_ids: list[str]) -> None:
        self._send(("abort", request_ids))

    def stop_sequences(self, stops: list[tuple[str, int]]) -> None:
        self._send(("stop", stops))

    def remove_lora(self, lora_int_id: int) -> None:
        self._send(("remove_lora", lora_int_id))

    def step(self) -> EngineCoreOutputs:
        """The outputs of the core's next step, merged with any that followed it."""
        if self._pending_error is not None:
            error, self._pending_error = self._pending_error, None
            raise error
        while True:
            try:
                kind, payload = self._outputs.get(timeout=_LIVENESS_CHECK_S)
                break
            except queue.Empty:
                if not self._process.is_alive():
                    raise RuntimeError("the engine core process exited") from None
        if kind == "step_error":
            raise payload
        merged = payload
        while True:
            try:
                kind, payload = self._outputs.get_nowait()
            except queue.Empty:
                return merged
            if kind == "step_error":
                self._pending_error = payload
                return merged
            merged = _merge(merged, payload)

    def has_unfinished_requests(self) -> bool:
        """The front's own requests say; the core steps on its own."""
        return False

    def run_idle_work(self) -> bool:
        """The core process does its deferred work itself, in the background."""
        return False

    def start_background_work(self) -> None:
        """Started by the core process itself."""

    def dead_reason(self) -> str | None:
        """The core process's end (its own workers' deaths fail its steps)."""
        if self._process.is_alive():
            return None
        return f"the engine core process exited (code {self._process.exitcode})"

    def stats(self) -> SchedulerStats:
        return self._stats

    def dashboard_snapshot(self) -> dict:
        """Asked of the core, which answers between two of its steps. One caller at a time
        (the front's engine thread), so the answer that comes is this call's."""
        self._send(("snapshot", None))
        while True:
            try:
                return self._snapshots.get(timeout=_LIVENESS_CHECK_S)
            except queue.Empty:
                if not self._process.is_alive():
                    raise RuntimeError("the engine core process exited") from None

    def shutdown(self) -> None:
        _stop(self._process, self._input)


def _stop(process: Any, connection: Connection) -> None:
    if not process.is_alive():
        return
    try:
        connection.send(("shutdown", None))
    except (OSError, ValueError):
        pass
    process.join(timeout=5)
    if process.is_alive():
        process.terminate()
        process.join(timeout=5)
