"""The CPU kernels' code for instruction sets this machine would not pick: built with the
AVX2 flags (no AVX-512: the 256-bit int4/int5 paths, unpacked 5-bit tiles) and the portable
x86-64 ones (the scalar loops), each kernel test file runs against that build in a process
of its own. Slow: each build takes ~50 s."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.ops import cpu as cpu_kernels

KERNEL_TESTS = ["tests/ops/cpu/test_int4_matmul.py", "tests/ops/cpu/test_int5_matmul.py",
                "tests/ops/cpu/test_int8_matmul.py", "tests/ops/cpu/test_decode_attention.py"]


@pytest.mark.slow
@pytest.mark.parametrize("flags", ["-march=native -mno-avx512f", "-march=x86-64"])
def test_kernels_built_for_other_instruction_sets_pass_their_tests(flags):
    if cpu_kernels.int8_matmul_op() is None:
        pytest.skip("no C++ toolchain to build the kernels")
    root = Path(__file__).parents[3]
    env = {**os.environ, "KVSERVE_CPU_ARCH_FLAGS": flags}
    check = subprocess.run([sys.executable, "-c", "from kvserve.ops import cpu; print(cpu.build_directory())"],
                           env=env, capture_output=True, text=True, cwd=root, timeout=60)
    assert check.stdout.strip() != str(cpu_kernels.build_directory()), "the variant must build apart"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *KERNEL_TESTS],
                         env=env, capture_output=True, text=True, cwd=root, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout.splitlines()[-1], run.stdout[-500:]
    assert flags in (Path(check.stdout.strip()) / "build.ninja").read_text()  # what the compiler was given
