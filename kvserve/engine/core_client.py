"""How the front talks to the engine core: plain requests in, output deltas and stats out."""

from __future__ import annotations

from typing import Protocol

from kvserve.engine.core import EngineCore
from kvserve.engine.messages import EngineCoreInfo, EngineCoreOutputs, EngineCoreRequest, SchedulerStats


class EngineCoreClient(Protocol):
    info: EngineCoreInfo

    def add_request(self, request: EngineCoreRequest) -> None: ...

    def abort_requests(self, request_ids: list[str]) -> None: ...

    def stop_sequences(self, stops: list[tuple[str, int]]) -> None:
        """End samples (request id, index) that a stop string ended."""

    def remove_lora(self, lora_int_id: int) -> None:
        """Forget a LoRA adapter's weights once no request runs on it."""

    def step(self) -> EngineCoreOutputs: ...

    def has_unfinished_requests(self) -> bool: ...

    def run_idle_work(self) -> bool: ...

    def start_background_work(self) -> None: ...

    def dead_reason(self) -> str | None: ...

    def stats(self) -> SchedulerStats: ...

    def dashboard_snapshot(self) -> dict:
        """The live dashboard's view of the core (kvserve/engine/dashboard_snapshot.py)."""

    def shutdown(self) -> None: ...


class InprocClient:
    """The core in the caller's thread: a step is a method call."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.info = core.info
        self.add_request = core.add_request
        self.abort_requests = core.abort_requests
        self.stop_sequences = core.stop_sequences
        self.remove_lora = core.remove_lora
        self.step = core.step
        self.has_unfinished_requests = core.has_unfinished_requests
        self.run_idle_work = core.run_idle_work
        self.start_background_work = core.start_background_work
        self.dead_reason = core.dead_reason
        self.stats = core.stats
        self.dashboard_snapshot = core.dashboard_snapshot

    def shutdown(self) -> None:
        self.core.shutdown()
