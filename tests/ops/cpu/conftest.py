"""Fixtures of kvserve's CPU kernel tests."""

from __future__ import annotations

import pytest

from kvserve.ops.cpu import int4_matmul_op


@pytest.fixture(scope="module")
def int4_matmul():
    """torch.ops.kvserve_cpu.int4_matmul (4- and 5-bit weights); skips without a toolchain."""
    op = int4_matmul_op()
    if op is None:
        pytest.skip("no C++ toolchain to build the kernel")
    return op
