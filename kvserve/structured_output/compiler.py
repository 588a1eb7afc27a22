"""The runner's compiled grammars: one per content, compiled on a background thread as soon
as a sequence that needs it arrives, so the compile overlaps that step's forward pass."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from kvserve.structured_output.grammar import build_grammar
from kvserve.structured_output.params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar

# Compiled grammars kept for reuse; each holds per-token tables of the vocabulary, so a
# few hundred are tens of megabytes.
MAX_CACHED_GRAMMARS = 256


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        import xgrammar as xgr

        # The model's vocabulary may be padded past the tokenizer's: the bitmask covers it.
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids),
        )
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, cache_enabled=False)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvserve-grammar")
        self._compiled: OrderedDict[tuple, Future[xgrammar.CompiledGrammar]] = OrderedDict()

    def prefetch(self, params: StructuredOutputsParams) -> None:
        """Start compiling the grammar unless it is compiled or under way."""
        key = params.key
        if key in self._compiled:
            self._compiled.move_to_end(key)
            return
        self._compiled[key] = self._executor.submit(self._compile, params)
        while len(self._compiled) > MAX_CACHED_GRAMMARS:
            self._compiled.popitem(last=False)

    def get(self, params: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        """The compiled grammar, waiting for its compile if it is still running."""
        self.prefetch(params)
        return self._compiled[params.key].result()

    def _compile(self, params: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        return self._compiler.compile_grammar(build_grammar(params))

    @property
    def num_cached(self) -> int:
        return len(self._compiled)
