"""Reading a server's /dashboard/events stream and decoding the block map it sends; load for
it to show."""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter

import httpx

from kvserve.core.block_map import CACHED, FIRST_OWNER, FREE, SHARED

STATE_NAMES = {FREE: "free", CACHED: "cached", SHARED: "shared"}


def fresh_prompt(num_tokens: int) -> list[int]:
    """Token ids no earlier request used, so none of its blocks is a prefix-cache hit."""
    return [random.randrange(1000, 40000) for _ in range(num_tokens)]


def stream_until(base_url: str, prompt: list[int], n: int, stop: threading.Event) -> None:
    """A long streamed completion, left (and so aborted) once `stop` is set."""
    body = {"prompt": prompt, "max_tokens": 400, "n": n, "ignore_eos": True, "temperature": 1.0, "seed": 0,
            "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=300) as response:
        for _ in response.iter_lines():
            if stop.is_set():
                return


def block_cells(event: dict) -> Counter:
    """Blocks per state and per owning request id, decoded from the run-length map here
    (not with the server's BlockMap.codes)."""
    runs, owners = event["block_map"]["runs"], event["block_map"]["owners"]
    cells: Counter = Counter()
    for code, count in zip(runs[::2], runs[1::2]):
        cells[STATE_NAMES.get(code) or owners[code - FIRST_OWNER]] += count
    return cells


def state_counts(cells: Counter) -> dict[str, int]:
    """(free, cached, used, shared) as /debug/kv counts them: used = shared + owned."""
    owned = sum(count for name, count in cells.items() if name not in STATE_NAMES.values())
    return {"free": cells["free"], "cached": cells["cached"], "used": cells["shared"] + owned,
            "shared": cells["shared"]}


def report_counts(report: dict) -> dict[str, int]:
    blocks = report["blocks"]
    return {"free": blocks["free"], "cached": blocks["cached"], "used": blocks["used"],
            "shared": report["sharing"]["shared_blocks"]}


class EventReader:
    """The stream read on a thread; `events` grows as they come."""

    def __init__(self, base_url: str, headers: dict[str, str] | None = None) -> None:
        self.events: list[dict] = []
        self.status_code: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(base_url, headers or {}), daemon=True)
        self._thread.start()

    def _read(self, base_url: str, headers: dict[str, str]) -> None:
        with httpx.stream("GET", f"{base_url}/dashboard/events", headers=headers, timeout=60) as response:
            self.status_code = response.status_code
            for line in response.iter_lines():
                if line.startswith("data: "):
                    self.events.append(json.loads(line.removeprefix("data: ")))
                if self._stop.is_set():
                    return

    def wait_for(self, predicate, timeout: float = 60.0, count: int = 1) -> dict:
        """The count-th event (from the start) for which predicate holds."""
        deadline = time.monotonic() + timeout
        checked = 0
        while time.monotonic() < deadline:
            while checked < len(self.events):
                event = self.events[checked]
                checked += 1
                if predicate(event):
                    count -= 1
                    if count == 0:
                        return event
            time.sleep(0.05)
        raise TimeoutError(f"no such event in {len(self.events)}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
