"""Sampler checks against an independent plain-Python reference of each transform."""

import math

import pytest
import torch

from kvserve.sample.sampler import Sampler, SamplingRow, compute_prompt_logprobs
from kvserve.sampling_params import SamplingParams

LOGITS = [2.0, 1.5, 1.0, 0.5, 0.2, -0.3, -1.0, -1.5, 0.8, -0.1]
EOS = [9]
PROMPT = [0, 5, 5]
OUTPUT = [1, 1, 1, 6, 3]


def reference_probs(
    logits: list[float], p: SamplingParams, prompt: list[int], output: list[int],
    eos: list[int],
) -> list[float]:
    """Exact next-token distribution, written from the spec in plain Python."""
    x = list(logits)
    for tok, bias in (p.logit_bias or {}).items():
        x[tok] += bias
    if len(output) < p.min_tokens:
        for tok in list(p.stop_token_ids) + ([] if p.ignore_eos else eos):
            x[tok] = -math.inf
    seen = set(prompt) | set(output)
    for tok in seen:
        x[tok] = x[tok] / p.repetition_penalty if x[tok] > 0 else x[tok] * p.repetition_penalty
    for tok in set(output):
        count = output.count(tok)
        x[tok] -= p.frequency_penalty * count + p.presence_penalty
    if p.temperature < 1e-5:
        best = max(range(len(x)), key=lambda i: x[i])
        return [1.0 if i == best else 0.0 for i in range(len(x))]
    weights = [math.exp(v / p.temperature) if v != -math.inf else 0.0 for v in x]
    total = sum(weights)
    probs = [w / total for w in weights]
    order = sorted(range(len(x)), key=lambda i: -probs[i])
    keep = set(order[: p.top_k] if p.top_k > 0 else order)
    kept_mass = sum(probs[i] for i in keep)
    cumulative = 0.0
    for i in order:
        if i not in keep:
            continue
        if cumulative >= p.top_p:  # mass before this token already reaches top_p
            keep.discard(i)
        cumulative += probs[i] / kept_mass
    top = max(probs)
    keep = {i for i in keep if probs[i] >= p.min_p * top}
    total = sum(probs[i] for i in keep)
    return [probs[i] / total if i in keep else 0.0 for i in range(len(x))]


CASES = [
    SamplingParams(),
    SamplingParams(temperature=0.6),
    SamplingParams(temperature=1.5, top_k=3),
    SamplingParams(top_p=0.6),
    SamplingParams(temperature=0.8, top_k=6, top_p=0.75),
    SamplingParams(min_p=0.25),
    SamplingParams(repetition_penalty=1.8),
    SamplingParams(repetition_penalty=0.7),
    # Only the negative-logit penalised tokens (5, 6) keep real mass: multiplied, not divided.
    SamplingParams(repetition_penalty=2.0, logit_bias={t: -6.0 for t in (0, 1, 2, 3, 4, 7, 8, 9)}),
    SamplingParams(frequency_penalty=0.4, presence_penalty=0.5),
    SamplingParams(frequency_penalty=-0.3, presence_penalty=-0.2),
    SamplingParams(logit_bias={7: 3.5, 0: -2.0}),
    SamplingParams(min_tokens=6, stop_token_ids=[4], logit_bias={9: 3.0, 4: 3.0}),
    SamplingParams(min_tokens=6, ignore_eos=True, logit_bias={9: 3.0}),
    SamplingParams(min_tokens=2, logit_bias={9: 3.0}),  # already past min_tokens
    SamplingParams(temperature=0.9, top_k=5, top_p=0.9, min_p=0.1, repetition_penalty=1.2,
                   frequency_penalty=0.3, presence_penalty=0.2, logit_bias={8: 1.0}),
]


def make_row(params: SamplingParams, output: list[int] = OUTPUT, seed: int | None = None,
             prompt: list[int] = PROMPT) -> SamplingRow:
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingRow(params, prompt, output, generator, EOS)


def test_empirical_distributions_in_one_mixed_batch() -> None:
    torch.manual_seed(0)
    draws = 10_000
    rows = [make_row(p) for _ in range(draws) for p in CASES]  # cases interleaved
    logits = torch.tensor([LOGITS] * len(rows))
    tokens = torch.tensor(Sampler()(logits, rows).token_ids).view(draws, len(CASES))
    for c, params in enumerate(CASES):
        expected = reference_probs(LOGITS, params, PROMPT, OUTPUT, EOS)
        counts = torch.bincount(tokens[:, c], minlength=len(LOGITS)).tolist()
        for tok, (n, p) in enumerate(zip(counts, expected)):
            if p == 0.0:
                assert n == 0, f"case {c}: excluded token {tok} sampled {n} times"
            else:
                assert abs(n / draws - p) < 0.025, (c, tok, n / draws, p)


def test_reference_excludes_what_it_should() -> None:
    """Guard the reference itself on hand-checked cases."""
    top_k = reference_probs(LOGITS, SamplingParams(top_k=2), [], [], EOS)
    assert [i for i, p in enumerate(top_k) if p > 0] == [0, 1]
    greedy = reference_probs(LOGITS, SamplingParams(temperature=0, repetition_penalty=2.0),
                             [0], [], EOS)
    assert greedy.index(1.0) == 1  # 2.0 / 2 = 1.0 < 1.5


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0, repetition_penalty=2.0),
    SamplingParams(temperature=0, frequency_penalty=0.2, presence_penalty=1.0),
    SamplingParams(temperature=0, logit_bias={6: 4.0}),
    SamplingParams(temperature=0, min_tokens=10, logit_bias={9: 5.0}),
])
def test_greedy_is_argmax_after_processing(params: SamplingParams) -> None:
    expected = reference_probs(LOGITS, params, PROMPT, OUTPUT, EOS).index(1.0)
    mixed = [make_row(SamplingParams(temperature=1.0)), make_row(params)]
    out = Sampler()(torch.tensor([LOGITS, LOGITS]), mixed)
    assert out.token_ids[1] == expected


def test_greedy_penalty_changes_choice() -> None:
    params = SamplingParams(temperature=0, repetition_penalty=2.0)
    out = Sampler()(torch.tensor([LOGITS]), [make_row(params, output=[], prompt=[0])])
    assert out.token_ids == [1]


def run_seeded(seed: int, position: int, batch: int, steps: int = 25) -> list[int]:
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    noise_gen = torch.Generator().manual_seed(1000 + position + batch)
    row_logits = torch.randn(steps, 50, generator=torch.Generator().manual_seed(7))
    tokens: list[int] = []
    sampler = Sampler()
    for step in range(steps):
        logits = torch.randn(batch, 50, generator=noise_gen)
        logits[position] = row_logits[step]
        rows = [make_row(SamplingParams(temperature=0.7), output=[]) for _ in range(batch)]
        rows[position] = SamplingRow(params, [], list(tokens), generator, EOS)
        # Another seeded row in the batch must not disturb ours.
        if batch > 1:
            other = (position + 1) % batch
            rows[other] = make_row(SamplingParams(seed=5), output=[], seed=5 + step)
        tokens.append(sampler(logits, rows).token_ids[position])
    return tokens


def test_seeded_rows_ignore_batch_composition() -> None:
    alone = run_seeded(seed=42, position=0, batch=1)
    assert run_seeded(seed=42, position=3, batch=8) == alone
    assert run_seeded(seed=42, position=0, batch=5) == alone
    assert run_seeded(seed=43, position=0, batch=1) != alone


def test_logprobs_are_raw_log_softmax() -> None:
    torch.manual_seed(1)
    logits = torch.randn(5, 40) * 3
    raw = logits.clone()
    params = [
        SamplingParams(logprobs=5, temperature=0.5, repetition_penalty=1.5, top_k=3),
        SamplingParams(),
        SamplingParams(logprobs=0, frequency_penalty=1.0),
        SamplingParams(logprobs=3, temperature=0, logit_bias={0: 50.0}),
        SamplingParams(logprobs=40),
    ]
    rows = [make_row(p, output=[1, 2, 2]) for p in params]
    out = Sampler()(logits, rows)
    assert torch.equal(logits, raw), "sampler must not modify the caller's logits"
    assert out.token_ids[3] == 0
    reference = torch.log_softmax(raw.double(), dim=-1)
    for i, p in enumerate(params):
        if p.logprobs is None:
            assert out.logprobs[i] is None
            continue
        true_top = sorted(range(40), key=lambda t: -raw[i, t].item())[: p.logprobs]
        entry = out.logprobs[i]
        assert set(entry) == set(true_top) | {out.token_ids[i]}
        for tok, lp in entry.items():
            assert lp == pytest.approx(reference[i, tok].item(), abs=1e-5)


def test_compute_prompt_logprobs() -> None:
    torch.manual_seed(2)
    logits = torch.randn(4, 30)
    targets = [3, 17, 0, 29]
    entries = compute_prompt_logprobs(logits, targets, num_top=2)
    reference = torch.log_softmax(logits.double(), dim=-1)
    for i, entry in enumerate(entries):
        top2 = sorted(range(30), key=lambda t: -logits[i, t].item())[:2]
        assert set(entry) == set(top2) | {targets[i]}
        for tok, lp in entry.items():
            assert lp == pytest.approx(reference[i, tok].item(), abs=1e-5)
    with pytest.raises(ValueError):
        compute_prompt_logprobs(logits, targets[:3], num_top=1)


def test_common_case_copies_to_host_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    for name in ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _original=original, _name=name, **k):
            calls.append(_name)
            return _original(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    logits = torch.randn(6, 100)
    rows = [make_row(SamplingParams(temperature=t), output=[]) for t in (0, 0.7, 1.0) * 2]
    Sampler()(logits, rows)
    assert calls == ["tolist"]
    calls.clear()
    rows[0] = make_row(SamplingParams(logprobs=2, top_p=0.9, frequency_penalty=0.5))
    Sampler()(logits, rows)
    assert calls == ["tolist"]
