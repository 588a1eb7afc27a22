"""Medusa heads: the loader against the paper's head written here, bad checkpoints, greedy
output identical to no speculation with a token tree (a tiny Llama whose small vocabulary
makes random heads' candidates right often enough to accept tree branches, and SmolLM2),
and multi-candidate tree verification sampling exactly the target's distribution."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from kvserve import LLM, SamplingParams
from kvserve.model_executor.model_runner import kv_cache_bytes_per_block
from kvserve.spec_decode.medusa import MedusaProposer, load_medusa_heads
from kvserve.spec_decode.rejection_sampler import tree_rejection_run
from kvserve.spec_decode.tree import TokenTree
from tests.spec_decode.conftest import TINY_VOCAB
from tests.spec_decode.distribution import P_VALUE_THRESHOLD, chi_square_p_value


class ResBlock(nn.Module):
    """Medusa's residual block (Cai et al. 2024, eq. 1): x + SiLU(W1 x + b)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.nn.functional.silu(self.linear(x))


def reference_heads(hidden_size: int, vocab_size: int, num_heads: int, num_layers: int, seed: int) -> nn.ModuleList:
    """The Medusa repository's `medusa_head`: per head, residual blocks then an LM head."""
    torch.manual_seed(seed)
    return nn.ModuleList(
        nn.Sequential(*[ResBlock(hidden_size) for _ in range(num_layers)],
                      nn.Linear(hidden_size, vocab_size, bias=False))
        for _ in range(num_heads))


def save_medusa(directory: str, heads: nn.ModuleList, num_layers: int, fmt: str = "safetensors") -> str:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({"medusa_num_heads": len(heads), "medusa_num_layers": num_layers,
                   "base_model_name_or_path": "target"}, f)
    state = {name: tensor.contiguous() for name, tensor in heads.state_dict().items()}
    if fmt == "safetensors":
        save_file(state, os.path.join(directory, "medusa_lm_head.safetensors"))
    else:
        torch.save(state, os.path.join(directory, "medusa_lm_head.pt"))
    return directory




@pytest.fixture(scope="module")
def tiny_medusa(tmp_path_factory) -> str:
    return save_medusa(str(tmp_path_factory.mktemp("medusa")), reference_heads(32, TINY_VOCAB, 3, 1, seed=1), 1)


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
def test_loader_matches_the_paper_heads(fmt, tmp_path) -> None:
    reference = reference_heads(16, 40, num_heads=3, num_layers=2, seed=3)
    path = save_medusa(str(tmp_path / fmt), reference, num_layers=2, fmt=fmt)
    target = SimpleNamespace(hidden_size=16, vocab_size=40)  # what the loader checks of the target
    heads = load_medusa_heads(path, target, torch.float32, torch.device("cpu"))
    hidden = torch.randn(5, 16)
    expected = torch.stack([head(hidden) for head in reference])
    torch.testing.assert_close(heads(hidden), expected, rtol=1e-5, atol=1e-5)


def test_bad_heads_are_clear_errors_at_load(tiny_llama, tmp_path) -> None:
    wide = save_medusa(str(tmp_path / "wide"), reference_heads(48, TINY_VOCAB, 2, 1, seed=0), 1)
    with pytest.raises(ValueError, match="has hidden size 48; allowed: the target's hidden size \\(32\\)"):
        LLM(model=tiny_llama, skip_tokenizer_init=True, kv_cache_memory="4MiB", speculative_config={
            "method": "medusa", "model": wide, "num_speculative_tokens": 2})
    other_vocab = save_medusa(str(tmp_path / "vocab"), reference_heads(32, 30, 2, 1, seed=0), 1)
    with pytest.raises(ValueError, match="vocabulary of 30 tokens; allowed: the target's vocabulary \\(24 tokens\\)"):
        LLM(model=tiny_llama, skip_tokenizer_init=True, kv_cache_memory="4MiB", speculative_config={
            "method": "medusa", "model": other_vocab, "num_speculative_tokens": 2})
    two_heads = save_medusa(str(tmp_path / "two"), reference_heads(32, TINY_VOCAB, 2, 1, seed=0), 1)
    with pytest.raises(ValueError, match="the token tree is 3 deep; allowed: at most the checkpoint's 2 Medusa heads"):
        LLM(model=tiny_llama, skip_tokenizer_init=True, kv_cache_memory="4MiB", speculative_config={
            "method": "medusa", "model": two_heads, "num_speculative_tokens": 3,
            "speculative_token_tree": "[(0,), (0, 0), (0, 0, 0)]"})
    with pytest.raises(ValueError, match="1 to 16 nodes \\(a verify step's budget\\); it has 17"):
        LLM(model=tiny_llama, skip_tokenizer_init=True, kv_cache_memory="4MiB", speculative_config={
            "method": "medusa", "model": two_heads, "num_speculative_tokens": 16,
            "speculative_token_tree": [[i] for i in range(17)]})


def test_default_tree_puts_the_top_1_chain_first() -> None:
    tree = TokenTree.default(num_nodes=7, max_depth=3)
    assert tree.paths[:3] == [(0,), (0, 0), (0, 0, 0)]
    assert sorted(tree.paths) == sorted([(0,), (0, 0), (0, 0, 0), (1,), (0, 1), (0, 0, 1), (2,)])
    assert all(parent < node for node, parent in enumerate(tree.parents))


TREE = "[(0,), (0, 0), (0, 1), (1,), (1, 0), (2,)]"


def _tiny_run(path: str, speculative_config: dict | None, **kwargs) -> tuple[list[list[int]], LLM]:
    llm = LLM(model=path, skip_tokenizer_init=True, speculative_config=speculative_config, **kwargs)
    gen = torch.Generator().manual_seed(7)
    prompts = [{"prompt_token_ids": torch.randint(1, TINY_VOCAB, (n,), generator=gen).tolist()}
               for n in (5, 23, 11, 40)]
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)] * 4
    # Run beside them and not compared: sampled requests (verified by rejection sampling).
    others = [SamplingParams(temperature=0.9, seed=3, max_tokens=12, ignore_eos=True)]
    outputs = llm.generate(prompts + prompts[:1], params + others)
    return [list(o.outputs[0].token_ids) for o in outputs[:4]], llm


@pytest.mark.parametrize("case", ["batched", "small-chunks", "preemption"])
def test_tiny_llama_tree_greedy_is_exact(case, tiny_llama, tiny_medusa) -> None:
    block_size = 4
    kwargs = dict(block_size=block_size, kv_cache_memory="4MiB", enable_prefix_caching=False)
    if case == "small-chunks":
        kwargs["max_num_batched_tokens"] = 9
    if case == "preemption":
        num_blocks = (40 + 30) // block_size + 6  # one request fits, all at once do not
        per_block = kv_cache_bytes_per_block(_tiny_config(tiny_llama), block_size)
        kwargs.update(kv_cache_memory=str(num_blocks * per_block), max_model_len=num_blocks * block_size)
    plain, _ = _tiny_run(tiny_llama, None, **kwargs)
    config = {"method": "medusa", "model": tiny_medusa, "num_speculative_tokens": 6, "speculative_token_tree": TREE}
    spec, llm = _tiny_run(tiny_llama, config, **kwargs)
    assert spec == plain
    stats = llm.engine.spec_decode_stats
    assert stats.num_accepted_tokens > 0 and stats.num_drafts > 0
    assert llm.engine.core.kv_cache.num_free_blocks == llm.engine.core.runner.num_blocks
    if case == "preemption":
        assert llm.engine.core.scheduler.num_preemptions > 0


def _tiny_config(path: str):
    from kvserve.model_executor.loader import load_model

    return load_model(path, skip_tokenizer_init=True).config


def _record_accepted_paths(monkeypatch) -> list[list[int]]:
    """The accepted path of every greedy tree verification from now on (filled as they run)."""
    from kvserve.spec_decode import speculator as speculator_module

    paths: list[list[int]] = []
    greedy_tree_run = speculator_module.greedy_tree_run

    def recording(*args):
        run = greedy_tree_run(*args)
        paths.append(run.path)
        return run

    monkeypatch.setattr(speculator_module, "greedy_tree_run", recording)
    return paths


def test_tree_branches_are_accepted(tiny_llama, tiny_medusa, monkeypatch) -> None:
    """The tiny model's runs accept nodes off the top-1 chain (whose KV is then recomputed),
    not only chains: the tree is really exercised."""
    paths = _record_accepted_paths(monkeypatch)
    config = {"method": "medusa", "model": tiny_medusa, "num_speculative_tokens": 6, "speculative_token_tree": TREE}
    _tiny_run(tiny_llama, config, kv_cache_memory="4MiB")
    assert any(path and path[0] != 0 for path in paths)  # a second- or third-ranked root child
    assert any(path[:2] == [0, 1] for path in paths) or any(path[:1] == [3] for path in paths)


@pytest.mark.slow  # two 49k-token heads written and loaded: ~1 min on 2 cores
def test_smollm2_medusa_greedy_is_exact(smollm2_loaded, tmp_path) -> None:
    """Random heads on the real model (two heads, a branching tree): mostly rejected drafts,
    output identical to no speculation."""
    config = smollm2_loaded.config
    path = save_medusa(str(tmp_path / "m"), reference_heads(config.hidden_size, config.vocab_size, 2, 1, seed=0), 1)
    prompts = [{"prompt_token_ids": smollm2_loaded.tokenizer(p).input_ids}
               for p in ("The capital of France is", "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n")]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain = LLM(loaded=smollm2_loaded, kv_cache_memory="32MiB", max_model_len=256)
    spec = LLM(loaded=smollm2_loaded, kv_cache_memory="32MiB", max_model_len=256, speculative_config={
        "method": "medusa", "model": path, "num_speculative_tokens": 4, "speculative_token_tree": "[(0,), (0, 0), (1,), (2,)]"})
    assert ([o.outputs[0].token_ids for o in spec.generate(prompts, params)]
            == [o.outputs[0].token_ids for o in plain.generate(prompts, params)])
    assert spec.engine.spec_decode_stats.num_drafts > 0


def test_medusa_proposer_drafts_the_tree_from_the_heads_top_k() -> None:
    class FixedHeads(nn.Module):
        num_heads = 2
        lm_heads = [nn.Linear(1, 1)]
        draft_vocab = None

        def forward(self, hidden: torch.Tensor) -> torch.Tensor:
            # head 0 ranks tokens 5 > 3 > 1, head 1 ranks 2 > 4 (> 0 ...)
            logits = torch.zeros(2, hidden.shape[0], 8)
            logits[0, :, [5, 3, 1]] = torch.tensor([3.0, 2.0, 1.0])
            logits[1, :, [2, 4]] = torch.tensor([2.0, 1.0])
            return logits

    from kvserve.spec_decode.proposer import DraftContext

    tree = TokenTree([(0,), (0, 0), (0, 1), (1,), (2,)])
    proposer = MedusaProposer(FixedHeads(), tree)
    seq = DraftContext("s", [1, 2], 1, SamplingParams(), 10, None, torch.zeros(4))
    full, cut = proposer.propose([seq, seq], [5, 2])
    assert full.token_ids == [5, 2, 4, 3, 1] and full.parents == [-1, 0, 0, -1, -1]
    assert cut.token_ids == [5, 2] and cut.parents == [-1, 0]


def test_tree_rejection_sampling_matches_the_target_distribution() -> None:
    """Two emitted tokens through a tree with two root candidates, one with two children of
    its own: the pair (first, second) is distributed as p_root(first) * p_next(second | first)
    whatever the candidates (chi-square, as the chain sampler's tests)."""
    vocab = 5
    gen = torch.Generator().manual_seed(0)
    root = torch.tensor([0.1, 0.4, 0.2, 0.25, 0.05])
    after = {t: torch.softmax(torch.randn(vocab, generator=gen), 0) for t in range(vocab)}
    drafts, parents = [1, 3, 0, 4], [-1, 0, 0, -1]  # 1 (children 3, 0), 4
    rows = torch.stack([root, after[1], after[3], after[0], after[4]])
    samples = []
    for _ in range(20000):
        run = tree_rejection_run(rows, drafts, parents, gen)
        first = run.token_ids[0]
        if len(run.token_ids) == 1:  # rejected at the root: a second token is drawn plainly
            second = int(torch.multinomial(after[first], 1, generator=gen))
        else:
            second = run.token_ids[1]
        samples.append((first, second))
    exact = {(a, b): float(root[a] * after[a][b]) for a in range(vocab) for b in range(vocab)}
    assert chi_square_p_value(samples, exact) > P_VALUE_THRESHOLD


def test_equal_lm_heads_are_shared_and_match_the_paper_heads(tmp_path) -> None:
    reference = reference_heads(16, 40, num_heads=3, num_layers=1, seed=4)
    with torch.no_grad():
        for head in reference[1:]:
            head[-1].weight.copy_(reference[0][-1].weight)
    path = save_medusa(str(tmp_path / "shared"), reference, num_layers=1)
    heads = load_medusa_heads(path, SimpleNamespace(hidden_size=16, vocab_size=40), torch.float32, torch.device("cpu"))
    assert heads.shares_lm_head
    hidden = torch.randn(2, 16)
    torch.testing.assert_close(heads(hidden), torch.stack([head(hidden) for head in reference]), rtol=1e-5, atol=1e-5)


def test_draft_vocab_heads_draft_target_tokens(tmp_path) -> None:
    """Heads over a reduced vocabulary: each LM head row stands for the target token
    `draft_vocab[row]`; the proposer drafts the top rows' target tokens."""
    reference = reference_heads(16, 6, num_heads=2, num_layers=1, seed=5)
    path = save_medusa(str(tmp_path / "reduced"), reference, num_layers=1)
    draft_vocab = torch.tensor([3, 7, 11, 20, 31, 39])
    state = load_file(os.path.join(path, "medusa_lm_head.safetensors"))
    save_file({**state, "draft_vocab": draft_vocab}, os.path.join(path, "medusa_lm_head.safetensors"))
    target = SimpleNamespace(hidden_size=16, vocab_size=40)
    heads = load_medusa_heads(path, target, torch.float32, torch.device("cpu"))
    hidden = torch.randn(1, 16)
    expected = [int(draft_vocab[head(hidden)[0].argmax()]) for head in reference]
    proposer = MedusaProposer(heads, TokenTree([(0,), (0, 0)]))
    draft = proposer.propose([SimpleNamespace(hidden_state=hidden[0])], [2])[0]
    assert draft.token_ids == expected
    save_file({**state, "draft_vocab": torch.tensor([3, 7, 11, 20, 31, 40])},
              os.path.join(path, "medusa_lm_head.safetensors"))
    with pytest.raises(ValueError, match="draft_vocab has shape \\(6,\\) and ids 3..40; allowed: one target token id \\(0..39\\)"):
        load_medusa_heads(path, target, torch.float32, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_gpu_triton_tree_greedy_is_exact(enforce_eager, tmp_path, monkeypatch) -> None:
    """Tree verify steps on the GPU's Triton attention (the tree mask as per-token bits),
    replayed from CUDA graphs (positions by depth and the bits inputs of the graph) and
    eagerly: greedy output equals no speculation, with branches off the top-1 chain accepted.
    The model is tiny_llama's but with heads of 16 dimensions (the kernels' dot needs 16)."""
    from tests.conftest import randomize

    config = LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    randomize(model, seed=0)
    tiny_llama = str(tmp_path / "llama")
    model.save_pretrained(tiny_llama)
    tiny_medusa = save_medusa(str(tmp_path / "medusa"), reference_heads(64, TINY_VOCAB, 3, 1, seed=1), 1)

    paths = _record_accepted_paths(monkeypatch)
    kwargs = dict(device="cuda", dtype="float32", attention_backend="triton", kv_cache_memory="16MiB",
                  enforce_eager=enforce_eager)
    plain, _ = _tiny_run(tiny_llama, None, **kwargs)
    config = {"method": "medusa", "model": tiny_medusa, "num_speculative_tokens": 6, "speculative_token_tree": TREE}
    spec, llm = _tiny_run(tiny_llama, config, **kwargs)
    assert spec == plain
    assert llm.engine.spec_decode_stats.num_accepted_tokens > 0
    assert any(path and path[0] != 0 for path in paths)
    graphs = llm.engine.core.runner.cuda_graphs
    if not enforce_eager:
        assert any(width > 1 for _, width, _ in graphs.replays), "no tree verify step replayed"
