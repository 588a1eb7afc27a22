"""EAGLE-1 heads: the loader and the draft layer's cached steps against the paper's head
built here from transformers' Llama decoder layer, bad checkpoints, and greedy output
identical to no speculation (a tiny Llama whose small vocabulary lets a random head's
drafts be accepted sometimes; batched, small chunks, preemption)."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from kvserve import LLM, SamplingParams
from kvserve.model_executor.model_runner import kv_cache_bytes_per_block
from kvserve.spec_decode.eagle import EagleCache, EagleProposer, load_eagle_head, paged_draft_cache
from tests.spec_decode.conftest import TINY_VOCAB

HIDDEN = 32


class ReferenceEagle(nn.Module):
    """EAGLE-1 (Li et al. 2024): fc fuses (token embedding, feature) pairs, one Llama decoder
    layer without its input norm runs over them, causally."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        config._attn_implementation = "eager"
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=True)
        self.layer = LlamaDecoderLayer(config, layer_idx=0)
        self.layer.input_layernorm = nn.Identity()
        self.rotary = LlamaRotaryEmbedding(config)

    def forward(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        x = self.fc(torch.cat([embeds, features], dim=-1))[None]
        n = x.shape[1]
        positions = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        return self.layer(x, attention_mask=mask, position_ids=positions,
                          position_embeddings=self.rotary(x, positions))[0]

    def state_dict_in_eagle_layout(self) -> dict[str, torch.Tensor]:
        state = {f"fc.{k}": v for k, v in self.fc.state_dict().items()}
        state.update({f"layers.0.{k}": v for k, v in self.layer.state_dict().items()})
        return state


def _head_config(hidden: int = HIDDEN, vocab: int = TINY_VOCAB) -> LlamaConfig:
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=48, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0, rms_norm_eps=1e-6)


def save_eagle(directory: str, reference: ReferenceEagle, config: LlamaConfig, fmt: str = "safetensors") -> str:
    os.makedirs(directory, exist_ok=True)
    config.save_pretrained(directory)
    state = {k: v.contiguous() for k, v in reference.state_dict_in_eagle_layout().items()}
    if fmt == "safetensors":
        save_file(state, os.path.join(directory, "model.safetensors"))
    else:
        torch.save(state, os.path.join(directory, "pytorch_model.bin"))
    return directory


def _random_reference(config: LlamaConfig, seed: int) -> ReferenceEagle:
    torch.manual_seed(seed)
    reference = ReferenceEagle(config)
    with torch.no_grad():
        for parameter in reference.parameters():
            parameter.normal_(0, 0.3)
    return reference


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_cached_steps_match_the_paper_head(fmt, tmp_path) -> None:
    config = _head_config()
    reference = _random_reference(config, seed=1)
    path = save_eagle(str(tmp_path / fmt), reference, config, fmt)
    head = load_eagle_head(path, SimpleNamespace(hidden_size=HIDDEN, vocab_size=TINY_VOCAB, num_attention_heads=4),
                           torch.float32, torch.device("cpu"))
    embeds, features = torch.randn(7, HIDDEN), torch.randn(7, HIDDEN)
    with torch.no_grad():
        expected = reference(embeds, features)
        cache, outputs = paged_draft_cache(head, num_blocks=4, block_size=2), []
        for start, end in ((0, 3), (3, 5), (5, 6), (6, 7)):  # a catch-up, then single steps
            assert cache.reserve("s", end - start)
            rows = cache.extend(["s"], [end - start])
            outputs.append(head(embeds[start:end], features[start:end], torch.arange(start, end), rows))
    torch.testing.assert_close(torch.cat(outputs), expected, rtol=1e-4, atol=1e-4)


def test_features_seen_again_keep_the_heads_context(tmp_path) -> None:
    """A tree path through a lower-ranked branch has its KV recomputed in the next step, so
    the proposer sees that position's feature twice: it keeps the pairs and cache it has
    (drafting exactly as if each feature came once) rather than starting over."""
    from kvserve.spec_decode.eagle import EagleProposer, top_ids
    from kvserve.spec_decode.proposer import DraftContext

    config = _head_config()
    path = save_eagle(str(tmp_path / "head"), _random_reference(config, seed=3), config)
    head = load_eagle_head(path, SimpleNamespace(hidden_size=HIDDEN, vocab_size=TINY_VOCAB, num_attention_heads=4),
                           torch.float32, torch.device("cpu"))
    embed, lm_head = nn.Embedding(TINY_VOCAB, HIDDEN), torch.randn(TINY_VOCAB, HIDDEN)
    tokens, features = torch.randint(0, TINY_VOCAB, (12,)).tolist(), torch.randn(12, HIDDEN)

    def drafts(feeds: list[tuple[int, int]]) -> list[list[int]]:
        proposer = EagleProposer(head, embed, lambda estimate, n: top_ids(estimate @ lm_head.T, n),
                                 paged_draft_cache(head, num_blocks=8, block_size=4))
        out = []
        for start, end in feeds:  # observe features [start, end), then draft after token end
            proposer.observe("s", start, features[start:end])
            context = DraftContext("s", tokens[: end + 1], 3, SamplingParams(), 64, None)
            out.append(proposer.propose([context], [3])[0].token_ids)
        return out

    once = drafts([(0, 5), (5, 7), (7, 9)])
    assert once[0] and drafts([(0, 5), (4, 7), (6, 9)]) == once


@pytest.mark.parametrize("tree", [None, "[(0,), (0, 0), (1,), (2,)]"], ids=["chain", "tree"])
def test_sequences_draft_in_one_batch_as_they_would_alone(tree, tmp_path) -> None:
    """Three sequences of different lengths, catch-ups and draft lengths (one drafting none)
    proposed in one batch draft exactly what each proposes on its own."""
    from kvserve.spec_decode.config import SpeculativeConfig
    from kvserve.spec_decode.eagle import EagleProposer, top_ids
    from kvserve.spec_decode.proposer import DraftContext

    config = _head_config()
    path = save_eagle(str(tmp_path / "head"), _random_reference(config, seed=4), config)
    head = load_eagle_head(path, SimpleNamespace(hidden_size=HIDDEN, vocab_size=TINY_VOCAB, num_attention_heads=4),
                           torch.float32, torch.device("cpu"))
    embed, lm_head = nn.Embedding(TINY_VOCAB, HIDDEN), torch.randn(TINY_VOCAB, HIDDEN)
    token_tree = None if tree is None else SpeculativeConfig.from_dict(
        {"method": "eagle", "model": path, "num_speculative_tokens": 4, "speculative_token_tree": tree}).eagle_tree()
    lengths, ks = [9, 4, 15], [3, 0, 4] if tree is None else [4, 0, 2]
    tokens = [torch.randint(0, TINY_VOCAB, (n,)).tolist() for n in lengths]
    features = [torch.randn(n, HIDDEN) for n in lengths]

    def proposer() -> EagleProposer:
        return EagleProposer(head, embed, lambda estimate, n: top_ids(estimate @ lm_head.T, n),
                             paged_draft_cache(head, num_blocks=16, block_size=4), token_tree)

    def contexts(rounds: int, ids: list[int]) -> list[DraftContext]:
        return [DraftContext(f"s{i}", tokens[i][: lengths[i] - 2 + rounds], 2, SamplingParams(), 64, None) for i in ids]

    batched, alone = proposer(), [proposer() for _ in lengths]
    for rounds in (1, 2):  # a first catch-up over the whole prefix, then one more pair each
        for i, n in enumerate(lengths):
            first = 0 if rounds == 1 else n - 2
            batched.observe(f"s{i}", first, features[i][first : n - 2 + rounds])
            alone[i].observe(f"s{i}", first, features[i][first : n - 2 + rounds])
        together = batched.propose(contexts(rounds, [0, 1, 2]), ks)
        separately = [alone[i].propose(contexts(rounds, [i]), [ks[i]])[0] for i in range(3)]
        assert [(d.token_ids, d.parents) for d in together] == [(d.token_ids, d.parents) for d in separately]
        assert [len(d.token_ids) for d in together] == ks


def test_training_cache_never_writes_given_tensors() -> None:
    keys, values = torch.randn(6, 2, 4), torch.randn(6, 2, 4)
    given = keys[:5].clone()
    branch = EagleCache(given, values[:5].clone())  # e.g. a prefix of another cache's keys
    branch.append(keys[5:6], values[5:6])
    assert torch.equal(given, keys[:5]) and torch.equal(branch.keys, keys[:6])


@pytest.fixture(scope="module")
def tiny_eagle(tmp_path_factory) -> str:
    config = _head_config()
    return save_eagle(str(tmp_path_factory.mktemp("eagle")), _random_reference(config, seed=2), config)


def test_bad_heads_are_clear_errors_at_load(tiny_llama, tmp_path) -> None:
    wide_config = _head_config(hidden=48)
    wide = save_eagle(str(tmp_path / "wide"), _random_reference(wide_config, 0), wide_config)
    with pytest.raises(ValueError, match="into hidden size 48; allowed: the target's hidden size 32"):
        LLM(model=tiny_llama, skip_tokenizer_init=True, kv_cache_memory="4MiB",
            speculative_config={"method": "eagle", "model": wide, "num_speculative_tokens": 2})
    vocab_config = _head_config(vocab=30)
    other_vocab = save_eagle(str(tmp_path / "vocab"), _random_reference(vocab_config, 0), vocab_config)
    with pytest.raises(ValueError, match="vocabulary of 30 tokens; allowed: the target's vocabulary \\(24 tokens\\)"):
        LLM(model=tiny_llama, skip_tokenizer_init=True, kv_cache_memory="4MiB",
            speculative_config={"method": "eagle", "model": other_vocab, "num_speculative_tokens": 2})
    os.makedirs(tmp_path / "empty")
    with open(tmp_path / "empty" / "config.json", "w") as f:
        json.dump({"hidden_size": HIDDEN}, f)
    with pytest.raises(ValueError, match="is not an EAGLE checkpoint"):
        LLM(model=tiny_llama, skip_tokenizer_init=True, kv_cache_memory="4MiB",
            speculative_config={"method": "eagle", "model": str(tmp_path / "empty"), "num_speculative_tokens": 2})


def _tiny_run(path: str, speculative_config: dict | None, **kwargs) -> tuple[list[list[int]], LLM]:
    llm = LLM(model=path, skip_tokenizer_init=True, speculative_config=speculative_config, **kwargs)
    gen = torch.Generator().manual_seed(7)
    prompts = [{"prompt_token_ids": torch.randint(1, TINY_VOCAB, (n,), generator=gen).tolist()}
               for n in (5, 23, 11, 40)]
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)] * 4
    others = [SamplingParams(temperature=0.9, seed=3, max_tokens=12, ignore_eos=True)]
    outputs = llm.generate(prompts + prompts[:1], params + others)
    return [list(o.outputs[0].token_ids) for o in outputs[:4]], llm


def _head_bytes_per_block(block_size: int) -> int:
    """What a block of the head's paged cache takes: keys and values of its one layer, fp32."""
    config = _head_config()
    return 2 * block_size * config.num_key_value_heads * (config.hidden_size // config.num_attention_heads) * 4


@pytest.mark.parametrize("case", ["batched", "small-chunks", "preemption"])
def test_tiny_llama_greedy_is_exact(case, tiny_llama, tiny_eagle) -> None:
    from kvserve.model_executor.loader import load_model

    block_size = 4
    kwargs = dict(block_size=block_size, kv_cache_memory="4MiB", enable_prefix_caching=False)
    if case == "small-chunks":
        kwargs["max_num_batched_tokens"] = 9
    if case == "preemption":
        num_blocks = (40 + 30) // block_size + 6  # one request fits, all at once do not
        per_block = kv_cache_bytes_per_block(load_model(tiny_llama, skip_tokenizer_init=True).config, block_size)
        kwargs.update(kv_cache_memory=str(num_blocks * (per_block + _head_bytes_per_block(block_size))),
                      max_model_len=num_blocks * block_size)
    plain, _ = _tiny_run(tiny_llama, None, **kwargs)
    spec, llm = _tiny_run(tiny_llama, {"method": "eagle", "model": tiny_eagle, "num_speculative_tokens": 3}, **kwargs)
    assert spec == plain
    stats = llm.engine.spec_decode_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    core = llm.engine.core
    draft_cache = core.runner.speculator.proposer.cache
    assert core.kv_cache.num_free_blocks == core.runner.num_blocks
    assert draft_cache.num_free_blocks == draft_cache.kv.shape[1] == core.runner.num_blocks
    if case == "preemption":
        assert core.scheduler.num_preemptions > 0
        assert core.runner.num_blocks == num_blocks  # the budget held the head's blocks too


def test_a_full_draft_cache_skips_drafting_and_stays_exact(tiny_llama, tiny_eagle, monkeypatch) -> None:
    """A head's pool too small for every sequence at once: a sequence that finds too few free
    blocks does not draft that step; greedy output stays identical to no speculation, and
    every block is back in the pool at the end."""
    from kvserve.spec_decode import eagle
    from kvserve.spec_decode.paged_draft_cache import PagedDraftCache

    num_blocks = 14  # the longest prompt and its drafts take 11 blocks of 4
    small_cache = eagle.paged_draft_cache
    monkeypatch.setattr(eagle, "paged_draft_cache",
                        lambda head, _, block_size, backend: small_cache(head, num_blocks, block_size, backend))
    refused = []
    reserve = PagedDraftCache.reserve
    monkeypatch.setattr(PagedDraftCache, "reserve",
                        lambda self, seq_id, count: reserve(self, seq_id, count) or refused.append(seq_id))
    kwargs = dict(block_size=4, kv_cache_memory="4MiB", enable_prefix_caching=False)
    plain, _ = _tiny_run(tiny_llama, None, **kwargs)
    spec, llm = _tiny_run(tiny_llama, {"method": "eagle", "model": tiny_eagle, "num_speculative_tokens": 3}, **kwargs)
    assert spec == plain
    assert refused and llm.engine.spec_decode_stats.num_accepted_tokens > 0
    assert llm.engine.core.runner.speculator.proposer.cache.num_free_blocks == num_blocks


# Depth 1: the top three candidates; the chain of top-1 candidates three deep.
EAGLE_TREE = "[(0,), (0, 0), (0, 0, 0), (1,), (2,)]"


def _record_tree_paths(monkeypatch) -> list[list[int]]:
    """The accepted path of every greedy tree verification from now on."""
    from kvserve.spec_decode import speculator as speculator_module

    paths: list[list[int]] = []
    greedy_tree_run = speculator_module.greedy_tree_run
    monkeypatch.setattr(speculator_module, "greedy_tree_run",
                        lambda *args: paths.append((run := greedy_tree_run(*args)).path) or run)
    return paths


def test_a_token_tree_is_greedy_exact_and_its_branches_are_accepted(tiny_llama, tiny_eagle, monkeypatch) -> None:
    """EAGLE with a token tree: the top candidates at each depth of the chain as siblings,
    verified in one pass; greedy output identical to no speculation, in mixed batches with
    small prefill chunks, and accepted paths that leave the top-1 chain."""
    paths = _record_tree_paths(monkeypatch)
    kwargs = dict(block_size=4, kv_cache_memory="4MiB", max_num_batched_tokens=9)
    plain, _ = _tiny_run(tiny_llama, None, **kwargs)
    config = {"method": "eagle", "model": tiny_eagle, "num_speculative_tokens": 5, "speculative_token_tree": EAGLE_TREE}
    spec, llm = _tiny_run(tiny_llama, config, **kwargs)
    assert spec == plain
    assert any(path and path[0] in (3, 4) for path in paths), "no sibling of the top candidate was accepted"
    assert llm.engine.core.kv_cache.num_free_blocks == llm.engine.core.runner.num_blocks


def test_a_tree_that_branches_off_the_top_chain_is_refused(tiny_llama, tiny_eagle) -> None:
    with pytest.raises(ValueError, match=r"node \(1, 0\) descends from a candidate that is not the top one"):
        LLM(model=tiny_llama, skip_tokenizer_init=True, kv_cache_memory="4MiB",
            speculative_config={"method": "eagle", "model": tiny_eagle, "num_speculative_tokens": 3,
                                "speculative_token_tree": "[(0,), (1,), (1, 0)]"})


@pytest.mark.parametrize("tree", [None, EAGLE_TREE], ids=["chain", "tree"])
def test_observed_features_are_the_targets_hidden_states(tree, tiny_llama, tiny_eagle, monkeypatch) -> None:
    """What the head is fed: for every position of every sequence, prefill chunks and
    verified drafts included (with a tree, the accepted path's rows, not the first rows),
    the target's last hidden state (after its final norm) as transformers computes it over
    the whole final sequence."""
    from kvserve.spec_decode.eagle import EagleProposer

    observed: dict[str, dict[int, torch.Tensor]] = {}
    observe = EagleProposer.observe

    def recording(self, seq_id, first_position, features):
        for i, feature in enumerate(features):
            observed.setdefault(seq_id, {})[first_position + i] = feature.clone()
        observe(self, seq_id, first_position, features)

    monkeypatch.setattr(EagleProposer, "observe", recording)
    paths = _record_tree_paths(monkeypatch)
    config = {"method": "eagle", "model": tiny_eagle, "num_speculative_tokens": 3}
    if tree is not None:
        config.update(num_speculative_tokens=5, speculative_token_tree=tree)
    llm = LLM(model=tiny_llama, skip_tokenizer_init=True, kv_cache_memory="4MiB", max_num_batched_tokens=9,
              speculative_config=config)
    prompt = list(range(1, 20))
    output = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    tokens = prompt + list(output[0].outputs[0].token_ids)
    assert llm.engine.spec_decode_stats.num_accepted_tokens > 0
    if tree is not None:  # paths through a sibling: the rows to observe are not the first ones
        assert any(path and path[0] in (3, 4) for path in paths)
    [features] = observed.values()
    hf = LlamaForCausalLM.from_pretrained(tiny_llama)
    with torch.no_grad():
        expected = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states[-1][0]
    positions = sorted(features)
    assert positions == list(range(len(tokens) - 1))  # every position but the last token's, once
    torch.testing.assert_close(torch.stack([features[p] for p in positions]), expected[:-1], rtol=1e-4, atol=1e-4)


def test_requests_that_never_draft_hand_the_head_no_features(tiny_llama, tiny_eagle, monkeypatch) -> None:
    """A request with n = 2 beside one that drafts: its samples are never observed (their
    features would be kept for as long as they run), and both outputs equal no speculation."""
    observed = set()
    observe = EagleProposer.observe
    monkeypatch.setattr(EagleProposer, "observe", lambda self, seq_id, first, features: (
        observed.add(seq_id), observe(self, seq_id, first, features))[1])
    prompts = [{"prompt_token_ids": [3, 9, 4, 17, 5, 11]}, {"prompt_token_ids": [7, 2, 13, 8]}]
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
              SamplingParams(n=2, temperature=0.0, max_tokens=12, ignore_eos=True)]
    kwargs = dict(model=tiny_llama, skip_tokenizer_init=True, kv_cache_memory="4MiB")
    plain = LLM(**kwargs).generate(prompts, params)
    llm = LLM(**kwargs, speculative_config={"method": "eagle", "model": tiny_eagle, "num_speculative_tokens": 2})
    spec = llm.generate(prompts, params)
    assert [[list(c.token_ids) for c in o.outputs] for o in spec] == [[list(c.token_ids) for c in o.outputs]
                                                                      for o in plain]
    assert llm.engine.spec_decode_stats.num_drafts > 0
    assert len(observed) == 1  # the drafting request's one sequence only


def _staggered_run(llm: LLM, prompts: list[list[int]], max_tokens: list[int], arrival_steps: list[int]
                   ) -> list[list[int]]:
    """Each prompt added at its arrival step; the engine stepped until all finish: greedy ids."""
    engine, results, step = llm.engine, {}, 0
    while len(results) < len(prompts):
        for index, arrival in enumerate(arrival_steps):
            if arrival == step:
                engine.add_request(str(index), {"prompt_token_ids": prompts[index]},
                                   SamplingParams(temperature=0.0, max_tokens=max_tokens[index], ignore_eos=True))
        for output in engine.step():
            if output.finished:
                results[int(output.request_id)] = list(output.outputs[0].token_ids)
        step += 1
    return [results[index] for index in range(len(prompts))]


def test_past_the_batch_size_limit_the_head_keeps_nothing_and_drafts_again_after(tiny_llama, tiny_eagle,
                                                                                  monkeypatch) -> None:
    """disable_by_batch_size 2: two requests draft, a third joins and while three run nobody
    drafts and the head is handed no features (they would pile up for as long as the batch
    stays large); once the third ends, the two draft again, their pairs restarting where
    their features resume. Greedy output equals no speculation."""
    pending = []  # after each observation, the most features any sequence holds unpaired
    observe = EagleProposer.observe

    def observing(self, seq_id, first, features):
        observe(self, seq_id, first, features)
        pending.append(max(len(state.features) for state in self._states.values()))

    monkeypatch.setattr(EagleProposer, "observe", observing)
    prompts = [[3, 9, 4, 17, 5, 11, 2, 8], [7, 2, 13, 8, 1, 6], [5, 5, 9, 1, 3, 12, 4]]
    max_tokens, arrivals = [40, 40, 12], [0, 0, 4]
    kwargs = dict(model=tiny_llama, skip_tokenizer_init=True, kv_cache_memory="4MiB")
    plain = _staggered_run(LLM(**kwargs), prompts, max_tokens, arrivals)
    llm = LLM(**kwargs, speculative_config={"method": "eagle", "model": tiny_eagle, "num_speculative_tokens": 2,
                                            "disable_by_batch_size": 2})
    drafts = []  # each proposal's drafting sequences (none are asked while three run)
    propose = EagleProposer.propose

    def proposing(self, seqs, num_tokens):
        result = propose(self, seqs, num_tokens)
        drafts.append([seq.seq_id for seq, draft in zip(seqs, result) if draft.token_ids])
        return result

    monkeypatch.setattr(EagleProposer, "propose", proposing)
    assert _staggered_run(llm, prompts, max_tokens, arrivals) == plain
    # The two drafted before the third came, and again in the last steps, after the gap
    # (the last proposal may ask one only: the other is at its length limit).
    assert len(drafts[0]) == 2 and len(set().union(*drafts[-3:])) == 2
    assert pending and max(pending) <= 8  # never more than a prompt's rows, not one a step more


def test_a_prefix_cache_hit_still_drafts_and_stays_exact(tiny_llama, tiny_eagle) -> None:
    """A later request whose prompt starts with a cached prefix never gets the target's
    features there: the head pairs from the first computed position on, and still drafts."""
    shared = list(range(1, 17))  # four full blocks of 4: cached after the first request
    prompts = [{"prompt_token_ids": shared + [3, 9, 4]}, {"prompt_token_ids": shared + [7, 2, 11, 5]}]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    kwargs = dict(skip_tokenizer_init=True, block_size=4, kv_cache_memory="4MiB", enable_prefix_caching=True)
    plain = LLM(model=tiny_llama, **kwargs)
    expected = [list(plain.generate(p, params)[0].outputs[0].token_ids) for p in prompts]
    llm = LLM(model=tiny_llama, speculative_config={"method": "eagle", "model": tiny_eagle,
                                                    "num_speculative_tokens": 3}, **kwargs)
    first = list(llm.generate(prompts[0], params)[0].outputs[0].token_ids)
    drafts_before = llm.engine.spec_decode_stats.num_drafts
    second = list(llm.generate(prompts[1], params)[0].outputs[0].token_ids)
    assert [first, second] == expected
    assert llm.engine.spec_decode_stats.num_drafts > drafts_before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tree", [None, EAGLE_TREE], ids=["chain", "tree"])
def test_gpu_greedy_is_exact_with_cuda_graphs(tree, tmp_path, monkeypatch) -> None:
    """EAGLE on the GPU: verify steps replay CUDA graphs (the graphs keep the hidden states
    the head reads), the head drafts on the device, batched; greedy output equals no
    speculation. Heads of 16 dimensions (the Triton kernels' dot needs 16)."""
    from tests.conftest import randomize

    config = LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    randomize(model, seed=0)
    model.save_pretrained(str(tmp_path / "llama"))
    head_config = _head_config(hidden=64)
    head = save_eagle(str(tmp_path / "eagle"), _random_reference(head_config, seed=2), head_config)
    kwargs = dict(device="cuda", dtype="float32", attention_backend="triton", kv_cache_memory="16MiB")
    plain, _ = _tiny_run(str(tmp_path / "llama"), None, **kwargs)
    spec_config = {"method": "eagle", "model": head, "num_speculative_tokens": 3}
    if tree is not None:
        spec_config.update(num_speculative_tokens=5, speculative_token_tree=tree)
    observed = []  # the storage of every feature tensor the head was handed
    observe = EagleProposer.observe
    monkeypatch.setattr(EagleProposer, "observe", lambda self, seq_id, first, features: (
        observed.append(features.untyped_storage().data_ptr()), observe(self, seq_id, first, features))[1])
    spec, llm = _tiny_run(str(tmp_path / "llama"), spec_config, **kwargs)
    assert spec == plain
    assert llm.engine.spec_decode_stats.num_accepted_tokens > 0
    graphs = llm.engine.core.runner.cuda_graphs
    assert any(width > 1 for _, width, _ in graphs.replays), "no verify step replayed"
    # Features a sequence keeps until it drafts again must outlive the next replay: none
    # may be a view of a graph's own hidden-state buffer, which that replay overwrites.
    buffers = {graph.hidden.untyped_storage().data_ptr() for graph in graphs.graphs.values()}
    assert observed and not buffers & set(observed)
