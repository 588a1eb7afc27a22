"""A decode step whose sampled ids are still on their way to the host (overlapped
scheduling): the next step can take them as inputs on the device first."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.utils import to_device_async


@dataclass
class InflightStep:
    seq_ids: list[str]
    token_ids: torch.Tensor  # [B] on the device: the inputs of a step launched after it
    host_token_ids: torch.Tensor  # [B] on the host, valid once `ready` has completed
    ready: torch.cuda.Event | None  # None when the ids were computed on the host

    @classmethod
    def start(cls, seq_ids: list[str], token_ids: torch.Tensor) -> InflightStep:
        """Queue the copy of the ids to the host behind the step's work."""
        if token_ids.device.type != "cuda":
            return cls(seq_ids, token_ids, token_ids, None)
        host = torch.empty(token_ids.shape, dtype=token_ids.dtype, pin_memory=True)
        host.copy_(token_ids, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return cls(seq_ids, token_ids, host, ready)

    def inputs_for(self, seq_ids: list[str]) -> torch.Tensor:
        """The sampled ids of `seq_ids` (a subsequence of this step's), on the device."""
        if seq_ids == self.seq_ids:
            return self.token_ids
        row = {seq_id: i for i, seq_id in enumerate(self.seq_ids)}
        rows = [row[seq_id] for seq_id in seq_ids]
        return self.token_ids[to_device_async(rows, torch.long, self.token_ids.device)]

    def read(self) -> list[int]:
        """The sampled ids, waiting for this step only (not for steps queued after it)."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host_token_ids.tolist()
