"""`kvserve train-drafter`: Medusa heads trained by self-distillation on a small text for a
tiny model agree with the target on held-out text far more often than a random head, and
load back as a drafter whose greedy output equals plain decoding."""

from __future__ import annotations

import re

import pytest

from kvserve import LLM, SamplingParams
from kvserve.entrypoints.cli import main

SENTENCES = [
    "The river rises in the northern hills and runs south through three small towns.",
    "Every morning the baker opens the shop at six and sells bread until noon.",
    "Our team meets on Monday to plan the week and on Friday to review it.",
    "The lighthouse keeper climbs the stairs each evening to light the lamp.",
    "A good habit is to write down three things you learned before going to sleep.",
]


@pytest.mark.slow  # ~1-2 min of training on 2 cores
def test_trained_heads_beat_a_random_head_and_draft_losslessly(tiny_smollm2_draft, tmp_path, capsys) -> None:
    data = tmp_path / "text.txt"
    data.write_text("\n\n".join(f"{s} {SENTENCES[(i + 1) % 5]} {SENTENCES[(i + 2) % 5]}"
                                for i, s in enumerate(SENTENCES * 4)))
    out = tmp_path / "heads"
    assert main(["train-drafter", "--method", "medusa", "--model", tiny_smollm2_draft, "--data", str(data),
                 "--out", str(out), "--num-heads", "2", "--chunk-tokens", "48", "--epochs", "12", "--train-lm-head",
                 "--held-out", "0.2", "--lr", "3e-3", "--kv-cache-memory", "8MiB"]) == 0
    printed = capsys.readouterr().out
    line = re.search(r"per draft position: ([\d.%, ]+); a random head: ([\d.%, ]+)", printed)
    trained = [float(v) / 100 for v in re.findall(r"([\d.]+)%", line.group(1))]
    random_head = [float(v) / 100 for v in re.findall(r"([\d.]+)%", line.group(2))]
    assert trained[0] > 0.5 and trained[0] > random_head[0] + 0.4, printed

    llm_kwargs = dict(model=tiny_smollm2_draft, kv_cache_memory="8MiB", max_model_len=256)
    prompt = [{"prompt_token_ids": LLM(**llm_kwargs).get_tokenizer()(SENTENCES[0]).input_ids}]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = LLM(**llm_kwargs).generate(prompt, params)[0].outputs[0].token_ids
    spec = LLM(**llm_kwargs, speculative_config={"method": "medusa", "model": str(out), "num_speculative_tokens": 2})
    assert spec.generate(prompt, params)[0].outputs[0].token_ids == plain
    assert spec.engine.spec_decode_stats.num_accepted_tokens > 0


def test_draft_vocabulary_keeps_the_most_predicted_tokens_and_relabels() -> None:
    import torch

    from kvserve.spec_decode.train_drafter import most_predicted_tokens, to_draft_labels

    labels = torch.tensor([[5, 5, 5, 2, 2, 9, -100], [9, 9, 9, 9, 7, -100, -100]])
    # counts: 9 x5, 5 x3, 2 x2, 7 x1; size 5 fills the rest with the lowest unseen id (0)
    vocab = most_predicted_tokens([(torch.zeros(7, 4), labels)], vocab_size=12, size=5)
    assert vocab.tolist() == [0, 2, 5, 7, 9]
    three = most_predicted_tokens([(torch.zeros(7, 4), labels)], vocab_size=12, size=3)
    assert three.tolist() == [2, 5, 9]
    assert to_draft_labels(labels, three, 12).tolist() == [[1, 1, 1, 0, 0, 2, -100], [2, 2, 2, 2, -100, -100, -100]]
