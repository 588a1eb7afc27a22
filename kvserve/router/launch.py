"""`--launch N`: start N local `kvserve serve` replicas for the router to front."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _num_gpus() -> int:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    if shutil.which("nvidia-smi") is None:
        return 0
    result = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return result.stdout.count("GPU ") if result.returncode == 0 else 0


def _gpus_per_replica(serve_args: list[str]) -> int:
    """--tensor-parallel-size (-tp) of the serve arguments: a replica's ranks take a GPU each."""
    for i, arg in enumerate(serve_args):
        for flag in ("--tensor-parallel-size", "-tp"):
            if arg == flag and i + 1 < len(serve_args):
                return int(serve_args[i + 1])
            if arg.startswith(flag + "="):
                return int(arg.split("=", 1)[1])
    return 1


def launch_replicas(count: int, serve_args: list[str], base_port: int | None) -> tuple[list[subprocess.Popen], list[str]]:
    """Start the replicas (they load their models while the router starts); return them and
    their URLs. With GPUs, each replica sees its own: one, or --tensor-parallel-size of them
    (round-robin when there are too few)."""
    if any(arg in ("--port", "--host") or arg.startswith(("--port=", "--host=")) for arg in serve_args):
        raise ValueError("--launch sets each replica's --host and --port; leave them out of the serve arguments")
    gpus = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpu_ids = [d.strip() for d in gpus.split(",") if d.strip()] if gpus else [str(i) for i in range(_num_gpus())]
    per_replica = _gpus_per_replica(serve_args)
    processes, urls = [], []
    for i in range(count):
        port = base_port + i if base_port is not None else _free_port()
        env = dict(os.environ)
        if gpu_ids:
            first = i * per_replica
            env["CUDA_VISIBLE_DEVICES"] = ",".join(
                gpu_ids[(first + rank) % len(gpu_ids)] for rank in range(per_replica))
        processes.append(subprocess.Popen(
            [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", "--host", "127.0.0.1",
             "--port", str(port), *serve_args], env=env))
        urls.append(f"http://127.0.0.1:{port}")
    return processes, urls


def stop_replicas(processes: list[subprocess.Popen], timeout_s: float) -> None:
    for process in processes:
        if process.poll() is None:
            process.terminate()
    for process in processes:
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
