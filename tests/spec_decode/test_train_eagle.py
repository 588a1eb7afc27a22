"""`kvserve train-drafter --method eagle`: the training forward is the served head's cached
steps; an EAGLE-1 head trained by self-distillation for a tiny model chains drafts that the
target accepts on held-out text far more often than a random head's, and loads back as a
drafter whose greedy output equals plain decoding."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.entrypoints.cli import main
from kvserve.spec_decode.eagle import EagleCache, EagleHead
from kvserve.spec_decode.train_eagle import chained_acceptance

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
        cache, served = EagleCache(), []
        for start, end in ((0, 4), (4, 5), (5, 8), (8, 9)):  # a catch-up, single steps, a chunk
            served.append(head(embeds[start:end], features[start:end], torch.arange(start, end), cache))
    torch.testing.assert_close(trained_path.detach(), torch.cat(served), rtol=1e-5, atol=1e-5)


class _OneHotTarget:
    """A target whose features are one-hot rows: its LM head is the identity."""

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.one_hot(token_ids, 32).float()

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        return features


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
    acceptance = chained_acceptance(_ShiftHead(1), _OneHotTarget(), [chunk], num_tokens=2)
    # Position 1, after tokens 0..s for s = 1..7: drafts 3 4 5 6 10 11 9 against 3 4 5 9 10 7 9: 5 of 7.
    # Position 2 is measured where token s + 1 exists and is the greedy one (s = 1..5): the
    # chains (3, 4) (4, 5) (5, 6) (-) (10, 11) against (3, 4) (4, 5) (5, 9) (9, 10) (10, 7): 2 of 5.
    assert acceptance == pytest.approx([5 / 7, 2 / 5])


@pytest.mark.slow  # ~1 min on 2 cores
def test_trained_head_beats_a_random_head_and_drafts_losslessly(tiny_smollm2_draft, tmp_path, capsys) -> None:
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
                 "--held-out", "0.2", "--lr", "3e-3", "--kv-cache-memory", "8MiB"]) == 0
    printed = capsys.readouterr().out
    line = re.search(r"per draft position: ([\d.%, ]+); a random head: ([\d.%, ]+)", printed)
    trained = [float(v) / 100 for v in re.findall(r"([\d.]+)%", line.group(1))]
    random_head = [float(v) / 100 for v in re.findall(r"([\d.]+)%", line.group(2))]
    # Measured: 50% and 70% (position 2 is measured on the generated, greedy, part only), a random head 0%.
    assert trained[0] > 0.4 and trained[0] > 2 * random_head[0] and trained[0] > random_head[0] + 0.3, printed
    assert trained[1] > 0.4 and trained[1] > 2 * random_head[1], printed

    prompt = [{"prompt_token_ids": llm.get_tokenizer()(SENTENCES[0]).input_ids}]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = LLM(**llm_kwargs).generate(prompt, params)[0].outputs[0].token_ids
    spec = LLM(**llm_kwargs, speculative_config={"method": "eagle", "model": str(out), "num_speculative_tokens": 2})
    assert spec.generate(prompt, params)[0].outputs[0].token_ids == plain
    assert spec.engine.spec_decode_stats.num_accepted_tokens > 0
