"""Tensor and pipeline parallelism over a Ray cluster: one actor per rank, placed by Ray on any node
(one GPU each on GPUs), so one model can span machines. Start the cluster with
`ray start --head` on one machine and `ray start --address HEAD:6379` on the others; kvserve
joins it with `ray.init(address="auto")` (or uses the Ray runtime already started in this
process). Every rank receives each step from the object store and runs it (with pipeline
stages, several steps are submitted before the first is read); the output of the first
rank of the last stage is the step's."""

from __future__ import annotations

import logging
import socket
from collections import deque
from typing import Any

import torch

from kvserve.core.sched.output import ModelRunnerOutput, SchedulerOutput
from kvserve.engine.engine_args import EngineArgs
from kvserve.executor.base import ParallelExecutor
from kvserve.executor.tp_worker import WorkerInfo, output_rank, start_rank, worker_device
from kvserve.logger import configure_logging

logger = logging.getLogger(__name__)


class RayWorker:
    """One rank in a Ray actor."""

    def __init__(self, num_threads: int, log_level: int) -> None:
        configure_logging(log_level)
        torch.set_num_threads(num_threads)
        self.runner: Any = None

    def rendezvous_address(self) -> str:
        """Where the group meets: this actor's node and a free port on it."""
        import ray

        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def start(self, args: EngineArgs, rank: int, world_size: int, init_method: str) -> WorkerInfo | None:
        # Ray shows each actor only its own GPU.
        self.runner, info = start_rank(args, rank, world_size, init_method, worker_device(args, 0))
        return info

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(sched)


def _connect() -> Any:
    try:
        import ray
    except ImportError:
        raise ValueError("distributed_executor_backend='ray' needs Ray: pip install 'kvserve[ray]'") from None
    if not ray.is_initialized():
        try:
            ray.init(address="auto")
        except ConnectionError as error:
            raise ValueError("distributed_executor_backend='ray' found no Ray cluster to join (start one "
                             f"with `ray start --head`, or use the mp backend on one host): {error}") from None
    return ray


class RayExecutor(ParallelExecutor):
    """What EngineCore reads of a ModelRunner, backed by one Ray actor per rank."""

    def __init__(self, args: EngineArgs) -> None:
        ray = _connect()
        self._ray = ray
        world_size = args.tensor_parallel_size * args.pipeline_parallel_size
        self._output_rank = output_rank(args)
        self._submitted: deque[list] = deque()  # each step's calls, one per rank
        gpus = 1 if args.resolved_device().type == "cuda" else 0
        actor = ray.remote(num_cpus=0 if gpus else 1, num_gpus=gpus)(RayWorker)
        self._workers = [actor.remote(1, logging.getLogger().level) for _ in range(world_size)]
        try:
            init_method = ray.get(self._workers[0].rendezvous_address.remote())
            infos = self._get([worker.start.remote(args, rank, world_size, init_method)
                               for rank, worker in enumerate(self._workers)])
        except BaseException:
            self.shutdown()
            raise
        self._adopt(infos[0])
        logger.info("tensor parallelism: %d ranks as Ray actors, %d KV blocks on each", world_size, self.num_blocks)

    def _get(self, refs: list) -> list:
        """The actors' answers; a failure names the ranks whose actors died (a rank whose
        peer died fails too, in its collective)."""
        ray = self._ray
        try:
            return ray.get(refs)
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as error:
            dead = []
            for rank, worker in enumerate(self._workers):
                try:
                    ray.get(worker.rendezvous_address.remote(), timeout=10)
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                    dead.append(str(rank))
            what = f"rank {', '.join(dead)} (Ray actors) died" if dead else "a rank failed"
            raise RuntimeError(f"tensor-parallel {what}: {error}") from None

    def submit(self, sched: SchedulerOutput) -> None:
        """An actor runs its calls in the order they were made, so a stage starts the next
        step while later stages run this one."""
        step = self._ray.put(sched)
        self._submitted.append([worker.execute.remote(step) for worker in self._workers])

    def receive(self) -> ModelRunnerOutput:
        """The oldest submitted step's output, once every rank has run it (a rank that
        failed it fails the step, by name)."""
        return self._get(self._submitted.popleft())[self._output_rank]

    def shutdown(self) -> None:
        for worker in self._workers:
            self._ray.kill(worker)
        self._workers = []
