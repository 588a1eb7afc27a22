"""Polling a condition that another process or thread makes true."""

from __future__ import annotations

import time
from typing import Callable


def wait_for(predicate: Callable[[], object], timeout: float = 30.0) -> bool:
    """Whether `predicate()` became truthy within `timeout` seconds (checked every 50 ms)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False
