"""The CPU kernels' build survives a process killed in the middle of it: torch's own build
lock is a file its waiters poll until it is gone, which a killed build leaves behind, so
without kvserve's flock every later start would wait forever."""

from __future__ import annotations

import fcntl
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.ops import cpu as cpu_kernels

# Holds the build lock of the directory in argv[1], leaves torch's lock file there as a
# build does while it runs, and waits to be killed.
HOLDER = """
import sys, time
from pathlib import Path
from kvserve.ops.cpu import _exclusive_build
directory = Path(sys.argv[1])
with _exclusive_build(directory):
    (directory / "lock").touch()
    print("holding", flush=True)
    time.sleep(600)
"""


def _killed_mid_build(directory: Path) -> None:
    """A process that took the build lock and was SIGKILLed while holding it; checks that
    it excluded this one while alive."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(directory)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        with open(directory / "kvserve.flock", "w") as handle, pytest.raises(BlockingIOError):
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert (directory / "lock").exists()


def test_a_build_killed_midway_leaves_nothing_that_blocks_the_next(tmp_path) -> None:
    _killed_mid_build(tmp_path)
    with cpu_kernels._exclusive_build(tmp_path):
        assert not (tmp_path / "lock").exists()


def test_the_kernels_load_after_a_killed_build() -> None:
    """The real build directory: after a holder is killed there, a fresh process loads the
    kernels (from the cache the setup built, or by building them)."""
    if cpu_kernels.int8_matmul_op() is None:
        pytest.skip("no C++ toolchain to build the kernels")
    _killed_mid_build(cpu_kernels.build_directory())
    loaded = subprocess.run([sys.executable, "-c", "from kvserve.ops import cpu; print(cpu.available())"],
                            capture_output=True, text=True, timeout=300)
    assert loaded.stdout.strip() == "True", loaded.stderr[-2000:]
