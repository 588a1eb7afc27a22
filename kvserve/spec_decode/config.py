"""`speculative_config` as users pass it (vLLM's keys), validated at engine start."""

from __future__ import annotations

import ast
from dataclasses import dataclass, fields
from typing import Any

from kvserve.quantization import QUANTIZATION_METHODS
from kvserve.spec_decode.tree import TokenTree

METHODS = ("ngram", "draft_model", "medusa", "eagle", "eagle3", "jump_forward")
MAX_SPECULATIVE_TOKENS = 16
# Speculation pays while a decode step is bound by reading the weights: verifying k extra
# tokens per sequence is then almost free. With many sequences running, the step already
# moves enough rows to be compute bound and the drafts' extra rows cost real time, so past
# this many running sequences nobody speculates that step (vLLM's disable_by_batch_size).
DEFAULT_DISABLE_BY_BATCH_SIZE = 8


def _error(name: str, value: object, allowed: str) -> ValueError:
    return ValueError(f"speculative_config: {name}={value!r} is invalid; allowed: {allowed}")


@dataclass
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    # ngram: the longest suffix n-gram (n from max down to min) found earlier in the
    # request's prompt + output proposes what followed it. jump_forward: a constrained
    # request's grammar proposes the text it forces (unconstrained requests do not draft).
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    # draft_model: a model directory / .gguf with the target's vocabulary, or "same".
    # medusa: a directory of Medusa heads for the target (the Medusa repository's layout).
    # eagle / eagle3: a directory of an EAGLE-1 / EAGLE-3 head for the target (the EAGLE
    # repository's layout).
    model: str | None = None
    quantization: str | None = None
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    # medusa, eagle, eagle3: the token tree as candidate-rank paths, e.g. "[(0,), (0, 0),
    # (1,)]" (vLLM's key; a list works too); its node count is num_speculative_tokens. None:
    # TokenTree.default for medusa, a chain for EAGLE (whose trees extend the top-1 chain
    # only: the other candidates at each depth are leaves).
    speculative_token_tree: str | list | None = None

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> SpeculativeConfig:
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(config).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise _error(unknown[0], config[unknown[0]], f"keys {sorted(known)}")
        for required in ("method", "num_speculative_tokens"):
            if required not in config:
                raise ValueError(f"speculative_config needs {required!r}")
        return cls(**config)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise _error("method", self.method, f"one of {list(METHODS)}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise _error("num_speculative_tokens", k, f"an integer in [1, {MAX_SPECULATIVE_TOKENS}]")
        if self.disable_by_batch_size < 1:
            raise _error("disable_by_batch_size", self.disable_by_batch_size, "an integer >= 1")
        if self.method == "ngram":
            if self.prompt_lookup_min < 1:
                raise _error("prompt_lookup_min", self.prompt_lookup_min, "an integer >= 1")
            if self.prompt_lookup_min > self.prompt_lookup_max:
                raise _error(
                    "prompt_lookup_min", self.prompt_lookup_min,
                    f"<= prompt_lookup_max ({self.prompt_lookup_max})",
                )
        elif self.method in ("eagle", "eagle3"):
            if not self.model:
                raise _error("model", self.model, f"a directory of an EAGLE head for method {self.method}")
            tree = self.eagle_tree()
            if tree is not None and tree.num_nodes != k:
                raise _error("num_speculative_tokens", k,
                             f"the token tree's node count ({tree.num_nodes}) when speculative_token_tree is given")
        elif self.method == "jump_forward":
            pass  # drafts come from the request's own grammar
        elif self.method == "medusa":
            if not self.model:
                raise _error("model", self.model, "a directory of Medusa heads for method medusa")
            tree = self.token_tree(num_heads=MAX_SPECULATIVE_TOKENS)
            if tree.num_nodes != k:
                raise _error("num_speculative_tokens", k,
                             f"the token tree's node count ({tree.num_nodes}) when speculative_token_tree is given")
        else:
            if not self.model:
                raise _error("model", self.model, "a model path or 'same' for method draft_model")
            if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
                raise _error("quantization", self.quantization, f"one of {list(QUANTIZATION_METHODS)}")

    def eagle_tree(self) -> TokenTree | None:
        """EAGLE's tree: speculative_token_tree (checked: only the top-1 chain branches), or
        None for a chain of num_speculative_tokens."""
        if self.speculative_token_tree is None:
            return None
        from kvserve.spec_decode.eagle import check_eagle_tree

        tree = self.token_tree(num_heads=MAX_SPECULATIVE_TOKENS)
        check_eagle_tree(tree)
        return tree

    def token_tree(self, num_heads: int) -> TokenTree:
        """The tree a draft-head method verifies: speculative_token_tree, or the default of
        num_speculative_tokens nodes at most `num_heads` deep."""
        spec = self.speculative_token_tree
        if spec is None:
            return TokenTree.default(self.num_speculative_tokens, num_heads)
        try:
            paths = ast.literal_eval(spec) if isinstance(spec, str) else spec
            tree = TokenTree([tuple(path) for path in paths])
        except (ValueError, TypeError, SyntaxError) as error:
            raise _error("speculative_token_tree", spec, f"a list of candidate-rank paths like "
                         f"[(0,), (0, 0), (1,)] ({error})") from None
        if not 1 <= tree.num_nodes <= MAX_SPECULATIVE_TOKENS:
            raise _error("speculative_token_tree", spec, f"1 to {MAX_SPECULATIVE_TOKENS} nodes (a verify step's "
                         f"budget); it has {tree.num_nodes}")
        return tree
