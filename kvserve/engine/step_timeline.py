"""Each step's token mix (prefill and decode tokens, sequences, preemptions), for the
dashboard's batch timeline. Recorded only while a dashboard watches: a watcher renews its
interest with every snapshot it takes, so a closed dashboard stops the recording within
WATCH_S."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable

from kvserve.core.sequence import Sequence

WATCH_S = 5.0
MAX_STEPS = 2048  # kept between two snapshots at most (a fast GPU steps ~100 times a second)


class StepTimeline:
    def __init__(self) -> None:
        self._steps: deque[list[float]] = deque(maxlen=MAX_STEPS)
        self._watched_until = 0.0

    def watch(self) -> None:
        self._watched_until = time.monotonic() + WATCH_S

    @property
    def watched(self) -> bool:
        return time.monotonic() < self._watched_until

    def record(self, scheduled: Iterable[tuple[Sequence, int]], num_preempted: int) -> None:
        """A step about to run: (sequence, tokens it runs), read before the step counts
        them as computed. A sequence with more than its newest token left to compute is
        prefilling (a prompt, or a preempted sequence's recompute); the others decode (their
        speculative drafts included)."""
        prefill = decode = num_seqs = 0
        for seq, num_tokens in scheduled:
            num_seqs += 1
            if seq.num_tokens - seq.num_computed_tokens > 1:
                prefill += num_tokens
            else:
                decode += num_tokens
        self._steps.append([round(time.time(), 3), prefill, decode, num_seqs, num_preempted])

    def take(self) -> list[list[float]]:
        """The steps recorded since the last take: [unix time, prefill tokens, decode tokens,
        sequences, sequences preempted]."""
        steps = list(self._steps)
        self._steps.clear()
        return steps
