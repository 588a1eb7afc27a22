"""Where a batch-invariant engine cuts prompts: at multiples of one fixed chunk size, counted
from the prompt's first token, whatever else the step runs.

A prompt's K/V depend in the last bits on the pieces it is computed in (the dense matmul's
result for a row changes with the rows of its call; pieces of up to 16 rows attend with
the decode kernel, longer ones with SDPA). Cut where the budget other requests leave
happens to end, the same prompt would get other K/V beside other requests than alone, and
a greedy token could flip at a near-tie. Cut at fixed boundaries, its pieces are a function
of the prompt and the configuration only: [0, C), [C, 2C), ..., [kC, L).

The prefix cache keeps that true: a hit may only skip whole canonical chunks whose K/V a
cold run of this prompt would have computed the same way, so only blocks computed inside a
full canonical prompt chunk are registered (never a prompt's shorter last chunk, whose
pieces depend on its length, nor decoded tokens, which a cold run of a longer prompt would
compute as prompt rows), and a hit is cut down to a chunk boundary.
"""

from __future__ import annotations

import math


def canonical_chunk_size(max_num_batched_tokens: int, max_num_seqs: int, block_size: int) -> int:
    """The step budget less room for one decode token of every running sequence (at most
    half the budget), in whole blocks: a prompt's chunk then fits beside the decodes of a
    full batch, and always in a step of its own."""
    reserved = min(max_num_seqs, max_num_batched_tokens // 2)
    size = (max_num_batched_tokens - reserved) // block_size * block_size
    return size if size > 0 else max_num_batched_tokens


class CanonicalChunks:
    def __init__(self, chunk_size: int | None, block_size: int) -> None:
        """`chunk_size`: None when prompts are never chunked (each runs whole, so no prefix
        hit ever gives a cold run's K/V)."""
        self.chunk_size = chunk_size
        # A usable hit ends at a chunk boundary and a block boundary.
        self._hit_unit = None if chunk_size is None else math.lcm(chunk_size, block_size)

    def next_piece(self, start: int, num_remaining: int) -> int:
        """Tokens of the prompt's next canonical piece, from `start` (a boundary or a
        prefix hit cut to one)."""
        if self.chunk_size is None:
            return num_remaining
        return min(num_remaining, self.chunk_size - start % self.chunk_size)

    def usable_hit_tokens(self, hit_tokens: int) -> int:
        """The part of a prefix-cache hit after which the prompt's pieces are a cold run's."""
        if self._hit_unit is None:
            return 0
        return hit_tokens // self._hit_unit * self._hit_unit

    def is_full_prompt_chunk(self, start: int, num_tokens: int, num_prompt_tokens: int) -> bool:
        """Whether [start, start + num_tokens) is a whole canonical chunk of prompt rows,
        computed exactly as in a cold run of any prompt that begins with those tokens."""
        return (self.chunk_size is not None and start % self.chunk_size == 0
                and num_tokens == self.chunk_size and start + num_tokens <= num_prompt_tokens)
