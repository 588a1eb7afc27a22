"""What the engine core reads of a ModelRunner, for executors whose ranks run elsewhere."""

from __future__ import annotations

from collections.abc import Callable

from kvserve.core.sched.output import ModelRunnerOutput, SchedulerOutput
from kvserve.executor.tp_worker import WorkerInfo


class ParallelExecutor:
    # CPU decode graphs, CUDA graphs and speculation run in one process only, for now.
    compiled_decode = None
    cuda_graphs = None
    speculator = None

    def _adopt(self, info: WorkerInfo) -> None:
        """What rank 0 reported once every rank was ready."""
        self.model_config = info.model_config
        self.tokenizer = info.tokenizer
        self.num_blocks = info.num_blocks
        self.kv_cache_dtype = info.kv_cache_dtype
        self.attention_backend_name = info.attention_backend_name
        self.decode_weight_bytes = info.decode_weight_bytes
        self.expert_weight_bytes = info.expert_weight_bytes

    def submit(self, sched: SchedulerOutput) -> None:
        """Start a step on every rank without waiting for it."""
        raise NotImplementedError

    def receive(self) -> ModelRunnerOutput:
        """The output of the oldest step submitted and not yet received."""
        raise NotImplementedError

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.submit(sched)
        return self.receive()

    def compile_idle(self) -> bool:
        return False

    def compile_in_background(self, busy: Callable[[], bool]) -> None:
        """Workers' steps run eager: nothing to compile."""
