"""`kvserve train-drafter --method eagle`: the training forward is the served head's cached
steps; an EAGLE-1 head trained by self-distillation for a tiny model chains drafts that the
target accepts on held-out text far more often than a random head's, and loads back as a
drafter whose greedy output equals plain decoding."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from kvserve import LLM, SamplingParams
from kvserve.entrypoints.cli import main
from kvserve.spec_decode.eagle import EagleHead, load_eagle_head, paged_draft_cache, target_lm_head_drafter
from kvserve.spec_decode.train_eagle import FrozenTarget, chained_acceptance, eagle_loss, save_eagle_head

from .test_train_drafter import SENTENCES


def _random_head(seed: int) -> EagleHead:
    torch.manual_seed(seed)
    head = EagleHead(32, 4, 2, 48, 10000.0, 1e-6, fc_bias=True)
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.normal_(0, 0.3)
    return head


def test_training_forward_equals_the_served_cached_steps() -> None:
    head = _random_head(0)
    embeds, features = torch.randn(9, 32), torch.randn(9, 32)
    trained_path = head.forward_sequence(embeds, features)
    assert trained_path.requires_grad  # differentiable: torch's matmuls, not the CPU kernel
    with torch.inference_mode():
        cache, served = paged_draft_cache(head, num_blocks=3, block_size=4), []
        for start, end in ((0, 4), (4, 5), (5, 8), (8, 9)):  # a catch-up, single steps, a chunk
            assert cache.reserve("s", end - start)
            rows = cache.extend(["s"], [end - start])
            served.append(head(embeds[start:end], features[start:end], torch.arange(start, end), rows))
    torch.testing.assert_close(trained_path.detach(), torch.cat(served), rtol=1e-5, atol=1e-5)


class _ShiftHead(torch.nn.Module):
    """Estimates the next feature as the given token's one-hot shifted by `shift` (a drafter
    that always drafts token + shift)."""

    def __init__(self, shift: int) -> None:
        super().__init__()
        self.shift = shift

    def forward(self, embeds, features, positions, cache):
        cache.append(torch.zeros(len(positions), 1, 1), torch.zeros(len(positions), 1, 1))
        return embeds.roll(self.shift, dims=-1)


def test_chained_acceptance_counts_drafts_through_each_position() -> None:
    # The target's greedy choice after each token; the text follows it but at its last token.
    token_ids = torch.tensor([1, 2, 3, 4, 5, 9, 10, 8])
    predictions = torch.tensor([2, 3, 4, 5, 9, 10, 7, 9])
    chunk = (token_ids, torch.zeros(8, 32), predictions)
    # A target whose features are one-hot rows: its embedding and LM head are the identity.
    one_hot = FrozenTarget(torch.eye(32), torch.eye(32))
    acceptance = chained_acceptance(_ShiftHead(1), one_hot, [chunk], num_tokens=2)
    # Position 1, after tokens 0..s where token s is the greedy one (s = 1..6; token 7 is not):
    # drafts 3 4 5 6 10 11 against 3 4 5 9 10 7: 4 of 6.
    # Position 2 is measured where token s + 1 exists and is the greedy one too (s = 1..5): the
    # chains (3, 4) (4, 5) (5, 6) (-) (10, 11) against (3, 4) (4, 5) (5, 9) (9, 10) (10, 7): 2 of 5.
    assert acceptance == pytest.approx([4 / 6, 2 / 5])


@pytest.mark.slow  # ~5 s each with one thread, ~40 s with two on a loaded 2-core machine
@pytest.mark.parametrize("options", [[], ["--feature-noise", "0.2", "--unroll-steps", "2", "--draft-vocab-size", "1024"]],
                         ids=["eagle-1", "noise-unrolled-draft-vocab"])
def test_trained_head_beats_a_random_head_and_drafts_losslessly(tiny_smollm2_draft, tmp_path, capsys,
                                                                options) -> None:
    # Self-distillation text: the tiny model's own greedy continuations of varied prompts, so
    # every draft position's acceptance is measured (see chained_acceptance).
    llm_kwargs = dict(model=tiny_smollm2_draft, kv_cache_memory="8MiB", max_model_len=256)
    llm = LLM(**llm_kwargs)
    prompts = [f"{s} {SENTENCES[(i + k) % 5]}" for k in range(1, 5) for i, s in enumerate(SENTENCES)]
    generated = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    data = tmp_path / "text.txt"
    data.write_text("\n\n".join(p + o.outputs[0].text for p, o in zip(prompts, generated)))
    out = tmp_path / "eagle"
    assert main(["train-drafter", "--method", "eagle", "--model", tiny_smollm2_draft, "--data", str(data),
                 "--out", str(out), "--num-speculative-tokens", "2", "--chunk-tokens", "48", "--epochs", "16",
                 "--held-out", "0.2", "--lr", "3e-3", "--kv-cache-memory", "8MiB", *options]) == 0
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert ("d2t" in f.keys()) == ("--draft-vocab-size" in options)
    printed = capsys.readouterr().out
    line = re.search(r"per draft position: ([\d.%, ]+); a random head: ([\d.%, ]+)", printed)
    trained = [float(v) / 100 for v in re.findall(r"([\d.]+)%", line.group(1))]
    random_head = [float(v) / 100 for v in re.findall(r"([\d.]+)%", line.group(2))]
    # Measured (generated text only): 77% and 74%; with noise, an unrolled step and 1,024 draft
    # tokens 59% and 57%; a random head 0%.
    assert trained[0] > 0.4 and trained[0] > 2 * random_head[0] and trained[0] > random_head[0] + 0.3, printed
    assert trained[1] > 0.4 and trained[1] > 2 * random_head[1], printed

    prompt = [{"prompt_token_ids": llm.get_tokenizer()(SENTENCES[0]).input_ids}]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = LLM(**llm_kwargs).generate(prompt, params)[0].outputs[0].token_ids
    spec = LLM(**llm_kwargs, speculative_config={"method": "eagle", "model": str(out), "num_speculative_tokens": 2})
    assert spec.generate(prompt, params)[0].outputs[0].token_ids == plain
    assert spec.engine.spec_decode_stats.num_accepted_tokens > 0


def _random_target(vocab_size: int = 40, hidden_size: int = 32,
                   draft_vocab: torch.Tensor | None = None) -> FrozenTarget:
    generator = torch.Generator().manual_seed(1)
    embedding = torch.randn(vocab_size, hidden_size, generator=generator)
    return FrozenTarget(embedding, torch.randn(vocab_size, hidden_size, generator=generator), draft_vocab)


def _step_loss(target: FrozenTarget, estimates, features, labels, cls_weight, draft_vocab) -> torch.Tensor:
    """EAGLE-1's per-step loss, the cross entropy by hand over the draft vocabulary's rows."""
    logits = F.linear(estimates, target.lm_head)
    if draft_vocab is not None:
        keep = torch.isin(labels, draft_vocab)
        logits, labels = logits[keep], torch.searchsorted(draft_vocab, labels[keep])
    log_probs = logits.log_softmax(dim=-1)
    cross_entropy = -log_probs[torch.arange(len(labels)), labels].mean()
    return F.smooth_l1_loss(estimates, features) + cls_weight * cross_entropy


def test_unrolled_steps_loss_equals_the_served_chain() -> None:
    # Step k of each pair t, computed as drafting does: the cached true pairs 0..t, then the
    # head's own estimates fed back one at a time with the target's greedy tokens.
    head = _random_head(2)
    draft_vocab = torch.tensor([0, 2, 3, 5, 8, 11, 13, 17, 19, 23, 29, 31, 37])
    target = _random_target(draft_vocab=draft_vocab)
    n, steps, cls_weight = 10, 3, 0.3
    token_ids, predictions = torch.randint(0, 40, (n,)), torch.randint(0, 40, (n,))
    features = torch.randn(n, 32)
    loss = eagle_loss(head, target, (token_ids, features, predictions), cls_weight, num_steps=steps, unroll_decay=0.5)
    with torch.inference_mode():
        chains = [[] for _ in range(steps)]
        for t in range(n - 1):
            cache = paged_draft_cache(head, num_blocks=4, block_size=4)
            assert cache.reserve("s", t + steps)
            estimate = head(target.embed(token_ids[1 : t + 2]), features[: t + 1], torch.arange(t + 1),
                            cache.extend(["s"], [t + 1]))[-1:]
            chains[0].append(estimate)
            for k in range(2, steps + 1):
                if t + k >= n:
                    break
                estimate = head(target.embed(predictions[t + k - 1 : t + k]), estimate, torch.tensor([t + k - 1]),
                                cache.extend(["s"], [1]))
                chains[k - 1].append(estimate)
        reference = sum(0.5 ** (k - 1) * _step_loss(target, torch.cat(chains[k - 1]), features[k:], predictions[k:],
                                                    cls_weight, draft_vocab)
                        for k in range(1, steps + 1))
    torch.testing.assert_close(loss.detach(), reference, rtol=1e-5, atol=1e-5)


def test_feature_noise_perturbs_only_the_training_inputs() -> None:
    head, target = _random_head(3), _random_target()
    n, width = 8, 0.4
    chunk = (torch.randint(0, 40, (n,)), torch.randn(n, 32), torch.randint(0, 40, (n,)))
    torch.manual_seed(5)
    noisy = eagle_loss(head, target, chunk, 0.1, feature_noise=width)
    torch.manual_seed(5)
    noise = (torch.rand(n - 1, 32) - 0.5) * width
    assert noise.abs().max() <= width / 2 and noise.abs().max() > width / 4
    token_ids, features, predictions = chunk
    with torch.no_grad():
        # The noise enters the head's inputs only; the regression targets stay the clean features.
        estimates = head.forward_sequence(target.embed(token_ids[1:]), features[:-1] + noise)
        reference = _step_loss(target, estimates, features[1:], predictions[1:], 0.1, None)
        clean = eagle_loss(head, target, chunk, 0.1)
    torch.testing.assert_close(noisy.detach(), reference, rtol=1e-5, atol=1e-5)
    assert abs(float(noisy.detach()) - float(clean)) > 1e-4


def test_draft_vocabulary_round_trips_as_d2t_and_drafts_over_its_rows(tmp_path) -> None:
    vocab_size, hidden_size = 40, 32
    head = _random_head(4)
    draft_vocab = torch.tensor([3, 7, 8, 20, 39])
    llm = SimpleNamespace(engine=SimpleNamespace(model_config=SimpleNamespace(vocab_size=vocab_size)))
    save_eagle_head(head, llm, str(tmp_path), draft_vocab)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert f.get_tensor("d2t").tolist() == [3, 6, 6, 17, 35]  # target id - draft id
    target_config = SimpleNamespace(hidden_size=hidden_size, vocab_size=vocab_size, num_attention_heads=4)
    loaded = load_eagle_head(str(tmp_path), target_config, torch.float32, torch.device("cpu"))
    assert loaded.draft_vocab.tolist() == [3, 7, 8, 20, 39]
    lm_head = torch.randn(vocab_size, hidden_size)
    estimates = torch.randn(64, hidden_size)
    full = target_lm_head_drafter(loaded, lm_head, lambda e: e @ lm_head.T)
    scores = (estimates @ lm_head.T)[:, [3, 7, 8, 20, 39]]
    vocab = torch.tensor([3, 7, 8, 20, 39])
    expected = vocab[scores.argsort(dim=-1, descending=True)[:, :3]]  # the best three, best first
    assert torch.equal(full(estimates, 1), expected[:, :1]) and torch.equal(full(estimates, 3), expected)
    # A sharded LM head: the same tokens from the full logits' columns.
    assert torch.equal(target_lm_head_drafter(loaded, None, lambda e: e @ lm_head.T)(estimates, 3), expected)
    # Without d2t the target's whole LM head drafts.
    head.draft_vocab = None
    assert torch.equal(target_lm_head_drafter(head, lm_head, lambda e: e @ lm_head.T)(estimates, 2),
                       (estimates @ lm_head.T).argsort(dim=-1, descending=True)[:, :2])
