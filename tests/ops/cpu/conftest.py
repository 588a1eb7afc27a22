"""Fixtures of kvserve's CPU kernel tests: each op, or a skip where the kernels cannot be
built (no C++ toolchain)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvserve.ops.cpu import int4_matmul_op, int8_matmul_op, lora_add_op


def _built(op: Callable[[], object]) -> object:
    kernel = op()
    if kernel is None:
        pytest.skip("no C++ toolchain to build kvserve's CPU kernels")
    return kernel


@pytest.fixture(scope="module")
def int4_matmul():
    """torch.ops.kvserve_cpu.int4_matmul (4- and 5-bit weights)."""
    return _built(int4_matmul_op)


@pytest.fixture(scope="module")
def int8_matmul():
    return _built(int8_matmul_op)


@pytest.fixture(scope="module")
def lora_add():
    return _built(lora_add_op)
