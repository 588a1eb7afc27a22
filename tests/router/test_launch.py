"""--launch: each replica gets GPUs of its own, its tensor-parallel size of them."""

from __future__ import annotations

import pytest

from kvserve.router import launch


class _Popen:
    def __init__(self, argv, env):
        self.argv, self.env = argv, env


@pytest.mark.parametrize("serve_args, expected", [
    ([], ["0", "1", "2", "3"]),
    (["--tensor-parallel-size", "2"], ["0,1", "2,3", "0,1", "2,3"]),
    (["-tp=4"], ["0,1,2,3"] * 4),
])
def test_gpus_per_replica(monkeypatch, serve_args, expected):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    monkeypatch.setattr(launch.subprocess, "Popen", _Popen)
    processes, urls = launch.launch_replicas(4, serve_args, base_port=9000)
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in processes] == expected
    assert urls == [f"http://127.0.0.1:{9000 + i}" for i in range(4)]
    argv = processes[0].argv
    assert argv[len(argv) - len(serve_args):] == serve_args


def test_port_and_host_belong_to_the_launcher():
    with pytest.raises(ValueError, match="--launch sets each replica's --host and --port"):
        launch.launch_replicas(1, ["--port", "9"], None)
