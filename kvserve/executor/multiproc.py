"""Tensor and pipeline parallelism on this host: one worker process per rank (tp_worker.py),
spawned at start. The engine core hands it steps as it would a ModelRunner, and with
pipeline stages several at once (submit, then receive); every rank takes each step from
its pipe, the first rank of the last stage answers."""

from __future__ import annotations

import logging
import socket
import weakref
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch

from kvserve.core.sched.output import ModelRunnerOutput, SchedulerOutput
from kvserve.engine.engine_args import EngineArgs
from kvserve.executor.base import ParallelExecutor
from kvserve.executor.tp_worker import WorkerInfo, output_rank, run_worker

logger = logging.getLogger(__name__)

_LIVENESS_CHECK_S = 1.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class MultiprocExecutor(ParallelExecutor):
    """What EngineCore reads of a ModelRunner, backed by tensor x pipeline parallel workers."""

    def __init__(self, args: EngineArgs) -> None:
        import multiprocessing

        world_size = args.tensor_parallel_size * args.pipeline_parallel_size
        self._output_rank = output_rank(args)
        device = args.resolved_device()
        if device.type == "cuda" and torch.cuda.device_count() < world_size:
            raise ValueError(f"{world_size} ranks (tensor x pipeline parallel) need {world_size} GPUs; "
                             f"this host has {torch.cuda.device_count()}")
        context = multiprocessing.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        # Each rank computes on its share of the cores.
        threads = max(1, torch.get_num_threads() // world_size) if device.type == "cpu" else 1
        self._connections: list[Connection] = []
        self._processes = []
        for rank in range(world_size):
            ours, theirs = context.Pipe()
            process = context.Process(
                target=run_worker, name=f"kvserve-tp-rank-{rank}",
                args=(args, rank, world_size, init_method, theirs, threads, logging.getLogger().level),
                daemon=True,
            )
            process.start()
            theirs.close()
            self._connections.append(ours)
            self._processes.append(process)
        weakref.finalize(self, _stop, self._processes, self._connections)
        self._adopt(self._wait_ready())
        logger.info("tensor parallelism: %d ranks, pipeline parallelism: %d stages with up to %d steps in "
                    "flight (%d processes on %s), %d KV blocks on each", args.tensor_parallel_size,
                    args.pipeline_parallel_size, args.pipeline_parallel_size, world_size, device, self.num_blocks)

    def _wait_ready(self) -> WorkerInfo:
        """Rank 0's WorkerInfo once every rank is ready; the first rank's error otherwise
        (the others are stopped: none is left behind)."""
        replies: dict[int, tuple[str, Any]] = {}
        try:
            while len(replies) < len(self._processes):
                for rank, connection in enumerate(self._connections):
                    if rank in replies:
                        continue
                    if connection.poll(_LIVENESS_CHECK_S / len(self._connections)):
                        try:
                            replies[rank] = connection.recv()
                        except (EOFError, OSError):
                            self._raise_dead()
                        if replies[rank][0] == "error":
                            raise replies[rank][1]
                    elif not self._processes[rank].is_alive():
                        raise RuntimeError(f"tensor-parallel rank {rank} exited while starting "
                                           f"(code {self._processes[rank].exitcode})")
        except BaseException:
            _stop(self._processes, self._connections)
            raise
        return replies[0][1]

    def _receive(self, rank: int) -> tuple[str, Any]:
        """The next message of rank `rank`, failing loudly if any rank has died."""
        connection = self._connections[rank]
        while not connection.poll(_LIVENESS_CHECK_S):
            if not all(process.is_alive() for process in self._processes):
                self._raise_dead()
        try:
            return connection.recv()
        except (EOFError, OSError):  # a reset, where the rank died with steps unread in its pipe
            self._raise_dead()

    def _raise_dead(self) -> None:
        for process in self._processes:
            process.join(timeout=_LIVENESS_CHECK_S)  # a rank its peer's death ends is ending too
        dead = [f"rank {rank} exited (code {process.exitcode})"
                for rank, process in enumerate(self._processes) if not process.is_alive()]
        raise RuntimeError(f"tensor-parallel {'; '.join(dead) or 'rank 0 closed its pipe'}")

    @property
    def dead_reason(self) -> str | None:
        """Why the workers cannot run steps any more (a rank has exited), or None."""
        dead = [f"rank {rank} exited (code {process.exitcode})"
                for rank, process in enumerate(self._processes) if not process.is_alive()]
        return f"tensor-parallel {'; '.join(dead)}" if dead else None

    def submit(self, sched: SchedulerOutput) -> None:
        """Hand every rank the step (pickled once) without waiting for it: each runs its
        steps in order, so a stage starts the next while later stages run this one."""
        try:
            _send_to_all(self._connections, ("execute", sched))
        except OSError:  # a rank's end of its pipe is gone: say which rank died
            self._raise_dead()

    def receive(self) -> ModelRunnerOutput:
        """The output of the oldest step submitted and not yet received."""
        _, output = self._receive(self._output_rank)
        return output

    def shutdown(self) -> None:
        _stop(self._processes, self._connections)


def _send_to_all(connections: list[Connection], message: tuple[str, Any]) -> None:
    payload = ForkingPickler.dumps(message)
    for connection in connections:
        connection.send_bytes(payload)


def _stop(processes: list, connections: list[Connection]) -> None:
    payload = ForkingPickler.dumps(("shutdown", None))
    for connection in connections:
        try:
            connection.send_bytes(payload)
        except (OSError, ValueError):
            pass  # that rank is gone
    for process in processes:
        process.join(timeout=5)
        if process.is_alive():
            process.terminate()
            process.join(timeout=5)
