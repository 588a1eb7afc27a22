"""The torch.compile'd CPU decode step against the eager forward it replaces."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import MistralConfig, MistralForCausalLM, Qwen3Config, Qwen3ForCausalLM

from kvserve import LLM, SamplingParams
from kvserve.engine.async_llm import AsyncLLM
from kvserve.engine.engine_args import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.model_executor.compiled_decode import CompiledDecode
from kvserve.model_executor.loader import load_model
from tests.quantization.prompts import PROMPTS

VOCAB = 256
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
ARCHITECTURES = {
    # A window shorter than the contexts, so it cuts in the compiled mask too.
    "mistral-sliding-window": lambda: MistralForCausalLM(MistralConfig(**SMALL, sliding_window=7)),
    "qwen3-qk-norm": lambda: Qwen3ForCausalLM(Qwen3Config(**SMALL, head_dim=32)),
}


PROMPT_LENS = (11, 4, 17)
# Three sequences of uneven lengths (padding, masks); then one alone: the batch-1 graph.
UNEVEN_BATCHES = [(0, 1, 2)] * 4
WITH_BATCH_1 = UNEVEN_BATCHES + [(1,)] * 3


def _compiled_against_eager(arch: str, batches: list[tuple[int, ...]], save_hf_model, paged_runner) -> None:
    loaded = load_model(save_hf_model(ARCHITECTURES[arch]()))
    eager = paged_runner(loaded.model, loaded.config)
    compiled_runner = paged_runner(loaded.model, loaded.config)  # same seed: same blocks
    compiled = CompiledDecode(loaded.model, compiled_runner.kv_caches, loaded.config.sliding_window)
    torch._dynamo.reset()  # graphs compiled by other tests would be reused
    graphs_before = counters["stats"]["unique_graphs"]
    gen = torch.Generator().manual_seed(3)
    prompts = {i: torch.randint(3, VOCAB, (n,), generator=gen).tolist() for i, n in enumerate(PROMPT_LENS)}
    next_tokens = {}
    for runner in (eager, compiled_runner):  # eager prefill for both
        logits = runner.step(list(prompts.items()))
        next_tokens = {i: int(out[-1].argmax()) for i, out in zip(prompts, logits)}
    for seq_ids in batches:
        batch = [(i, [next_tokens[i]]) for i in seq_ids]
        expected = eager.step(batch)
        ours = compiled_runner.step(batch, forward=compiled.forward)
        torch.testing.assert_close(torch.cat(ours), torch.cat(expected), atol=1e-5, rtol=1e-5)
        next_tokens.update((i, int(out[-1].argmax())) for i, out in zip(seq_ids, expected))
    for ours, reference in zip(compiled_runner.kv_caches, eager.kv_caches, strict=True):
        torch.testing.assert_close(ours, reference, atol=1e-6, rtol=1e-6)
    # One graph per batch kind (1, 2+), with dynamic context lengths: no recompiles per step.
    assert counters["stats"]["unique_graphs"] - graphs_before == len({len(b) > 1 for b in batches})


def test_compiled_decode_matches_eager(save_hf_model, paged_runner) -> None:
    """One graph only (~15 s of compiling on 2 cores); the batch-1 one in the slow tests."""
    _compiled_against_eager("mistral-sliding-window", UNEVEN_BATCHES, save_hf_model, paged_runner)


# (sequence, tokens) per step: a batch-1 verify step of 1 + 4 rows, a mixed step of a decode
# and two verify steps, then plain decodes of three sequences.
VERIFY_STEPS = [[(0, 5)], [(0, 1), (1, 4), (2, 2)], [(0, 1), (1, 1), (2, 1)], [(2, 5), (1, 1)]]


def test_verify_steps_take_the_decode_graph_and_match_decodes(save_hf_model, paged_runner) -> None:
    """A speculative verify step of 1 + k rows costs what a decode batch of as many rows
    does: it runs the compiled decode graph of its row count (no graph of its own: the
    2-16 rows graph serves decodes and verify steps alike), and eagerly the decode path's
    rows (no prefill gather). Each row's logits equal those of plain one-token decode steps
    at its position."""
    loaded = load_model(save_hf_model(ARCHITECTURES["mistral-sliding-window"]()))
    decodes, eager, compiled_runner = (paged_runner(loaded.model, loaded.config) for _ in range(3))
    compiled = CompiledDecode(loaded.model, compiled_runner.kv_caches, loaded.config.sliding_window)
    torch._dynamo.reset()
    graphs_before = counters["stats"]["unique_graphs"]
    gen = torch.Generator().manual_seed(5)
    prompts = {i: torch.randint(3, VOCAB, (n,), generator=gen).tolist() for i, n in enumerate(PROMPT_LENS)}
    for runner in (decodes, eager, compiled_runner):
        runner.step(list(prompts.items()))
    compiled_calls = []
    for step in VERIFY_STEPS:
        batch = [(i, torch.randint(3, VOCAB, (n,), generator=gen).tolist()) for i, n in step]
        expected = [torch.cat([decodes.step([(i, [token])])[0] for token in tokens]) for i, tokens in batch]
        forward = lambda *args: compiled_calls.append(1) or compiled.forward(*args)  # noqa: E731
        for runner, run_forward in ((eager, None), (compiled_runner, forward)):
            ours = runner.step(batch, forward=run_forward)
            torch.testing.assert_close(torch.cat(ours), torch.cat(expected), atol=1e-5, rtol=1e-5)
    assert len(compiled_calls) == len(VERIFY_STEPS)
    assert counters["stats"]["unique_graphs"] - graphs_before == 1
    for ours, reference in zip(compiled_runner.kv_caches, decodes.kv_caches, strict=True):
        torch.testing.assert_close(ours, reference, atol=1e-6, rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_compiled_decode_matches_eager_with_batch_1(arch, save_hf_model, paged_runner) -> None:
    _compiled_against_eager(arch, WITH_BATCH_1, save_hf_model, paged_runner)


def _agree_up_to_near_ties(ours, reference, tol: float) -> None:
    """Greedy outputs (with top-k logprobs) agree token for token, with logprobs within
    tol, up to the first position where both runs see their two candidates within tol of
    each other. The int4 kernels take bf16 activations and the int8 LM head returns bf16
    logits, so rounding moves logprobs by ~0.1 and makes near-ties (even exact ties) common:
    the eager path itself differs that much between batch 1 and batch 6 (measured up to
    0.12, and diverging at ties), compiled vs eager up to 0.2."""
    for i, (token, expected) in enumerate(zip(ours.token_ids, reference.token_ids, strict=True)):
        mine, theirs = ours.logprobs[i], reference.logprobs[i]
        if token != expected:
            assert expected in mine and token in theirs, (i, mine, theirs)
            assert abs(mine[token] - mine[expected]) < tol and abs(theirs[token] - theirs[expected]) < tol
            return
        assert abs(mine[token] - theirs[token]) < tol, (i, mine, theirs)


@pytest.mark.slow
def test_serve_defaults_with_compiled_decode_match_eager(smollm2_path) -> None:
    """The embedded SmolLM2 as `kvserve serve --compile-decode` runs it on CPU (int4
    linears, int8 LM head): greedy outputs as with the same engine's eager steps up to
    near-ties, at batch 1 and batch 6, and the compiled graph really ran."""
    llm = LLM(model=smollm2_path, quantization="auto", compile_decode=True,
              kv_cache_memory="256MiB", max_model_len=2048, enable_prefix_caching=False)
    runner = llm.engine.core.runner
    compiled, calls = runner.compiled_decode, []
    forward = compiled.forward
    compiled.forward = lambda *args: calls.append(1) or forward(*args)
    prompts = [{"prompt_token_ids": llm.get_tokenizer()(p).input_ids} for p in PROMPTS]
    # top-5: the bf16 logits of the int8 head tie exactly, sometimes three ways
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5)
    outputs = {}
    for name, decode in (("compiled", compiled), ("eager", None)):
        runner.compiled_decode = decode
        outputs[name] = [o.outputs[0] for o in llm.generate(prompts[:1], params) + llm.generate(prompts, params)]
    for ours, reference in zip(outputs["compiled"], outputs["eager"], strict=True):
        _agree_up_to_near_ties(ours, reference, tol=0.3)
    assert len(calls) == 2 * 23


def test_compile_decode_refuses_a_float8_cache(save_hf_model) -> None:
    """Refused before compiling anything: the DecodeContext attention does not scale float8."""
    path = save_hf_model(ARCHITECTURES["mistral-sliding-window"]())
    with pytest.raises(ValueError, match="--compile-decode needs"):
        LLM(model=path, compile_decode=True, kv_cache_dtype="fp8", kv_cache_memory="16MiB")


def test_serve_default_compiles_where_it_applies(save_hf_model, monkeypatch) -> None:
    """compile_decode=None (`kvserve serve`'s default): on for a CPU cache of the model's
    dtype, its graphs compiled before LLM() returns (offline batches leave no idle time),
    quietly off for a float8 one, which an explicit True refuses (above)."""
    path = save_hf_model(ARCHITECTURES["mistral-sliding-window"]())
    compiled_sizes = []

    def compile_next(self):
        if not self._pending:
            return False
        compiled_sizes.append(self._pending.pop(0))
        return True

    monkeypatch.setattr(CompiledDecode, "compile_next", compile_next)
    on = LLM(model=path, compile_decode=None, kv_cache_memory="16MiB")
    assert isinstance(on.engine.core.runner.compiled_decode, CompiledDecode) and compiled_sizes == [1, 2]
    off = LLM(model=path, compile_decode=None, kv_cache_dtype="fp8", kv_cache_memory="16MiB")
    assert off.engine.core.runner.compiled_decode is None and compiled_sizes == [1, 2]


def test_a_graph_per_band_of_the_kernel_row_threshold(save_hf_model) -> None:
    """Layers that leave their kernel for a dense copy above 4 rows split the batch-2+
    graph at 5 (a guard of the traced dispatch); the default threshold is the graphs' own
    limit, so no split."""
    from kvserve.quantization import get_quantization_method, quantize_model
    from kvserve.quantization.base import QuantizedLinear

    loaded = load_model(save_hf_model(ARCHITECTURES["qwen3-qk-norm"]()))
    quantize_model(loaded.model, get_quantization_method("int8"))
    compiled = CompiledDecode(loaded.model, [], None)
    assert compiled.graph_batch_sizes() == [1, 2]
    for module in loaded.model.modules():
        if isinstance(module, QuantizedLinear):
            module.keep_dense_weight(dtype=torch.bfloat16, kernel_max_rows=4)
    assert compiled.graph_batch_sizes() == [1, 2, 5]


def test_serve_default_falls_back_to_eager_when_compiling_fails(save_hf_model, monkeypatch) -> None:
    """No C++ compiler, say: serve's default still serves (eager steps, same outputs); an
    explicit --compile-decode reports the failure."""
    path = save_hf_model(ARCHITECTURES["mistral-sliding-window"]())

    def fail(self):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(CompiledDecode, "compile_next", fail)
    llm = LLM(model=path, compile_decode=None, kv_cache_memory="16MiB")
    assert llm.engine.core.runner.compiled_decode is None
    reference = LLM(model=path, compile_decode=False, kv_cache_memory="16MiB")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = [{"prompt_token_ids": [5, 6, 7, 8]}]
    assert (llm.generate(prompt, params)[0].outputs[0].token_ids
            == reference.generate(prompt, params)[0].outputs[0].token_ids)
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        LLM(model=path, compile_decode=True, kv_cache_memory="16MiB")


def test_serve_default_compiles_while_idle_and_steps_eager_until_then(save_hf_model) -> None:
    """compile_decode=None under AsyncLLM (`kvserve serve`): the engine is up before any
    decode graph is compiled, a request that arrives then is served (eager steps, after the
    compile in progress), the idle engine compiles both graphs, and later decode steps run
    them; greedy tokens as eager steps give, throughout. /metrics' gauge counts the graphs
    still to compile (what a benchmark waits for)."""
    from kvserve.metrics import ServerMetrics

    path = save_hf_model(ARCHITECTURES["mistral-sliding-window"]())
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 10, 11]}]
    eager = LLM(model=path, compile_decode=False, kv_cache_memory="16MiB")
    reference = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    async_llm = AsyncLLM.from_engine_args(EngineArgs(model=path, compile_decode=None, kv_cache_memory="16MiB"))

    async def generate_all() -> list[list[int]]:
        async def one(prompt) -> list[int]:
            async for output in async_llm.generate(prompt, params):
                final = output
            return final.outputs[0].token_ids

        return list(await asyncio.gather(*(one(prompt) for prompt in prompts)))

    async def main():
        engine = await async_llm.started()
        metrics = ServerMetrics("m")
        metrics.attach_engine(engine)
        compiled = engine.core.runner.compiled_decode
        pending_at_start = compiled.pending, metrics.exposition().decode()
        early = await generate_all()
        deadline = time.monotonic() + 600
        while compiled.pending and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        calls = []
        forward = compiled.forward
        compiled.forward = lambda *args: calls.append(1) or forward(*args)
        late = await generate_all()
        return pending_at_start, early, (compiled.pending, metrics.exposition().decode()), late, len(calls)

    try:
        pending_at_start, early, pending_after, late, compiled_steps = asyncio.run(main())
    finally:
        async_llm.shutdown()
    assert pending_at_start[0] == 2 and pending_after[0] == 0  # batch 1, batch 2-16
    assert 'kvserve:decode_graphs_pending{model_name="m"} 2.0' in pending_at_start[1]
    assert 'kvserve:decode_graphs_pending{model_name="m"} 0.0' in pending_after[1]
    assert early == reference and late == reference
    # 12 tokens each, the first from the prefill: at least 11 decode-only steps (11 when both
    # requests are scheduled together; more if the second one's prefill lands later).
    assert compiled_steps >= 11


def test_two_models_keep_their_own_graphs(save_hf_model, paged_runner) -> None:
    """Two models of one architecture, one of them int8, compiled in one process (as a
    server's model and its draft model may be): the graphs skip Dynamo's guards on the model,
    so each instance must keep graphs of its own: a lookup of the other's graph would run it
    on modules it was not traced for."""
    from kvserve.quantization import get_quantization_method, quantize_model

    torch._dynamo.reset()
    models = []
    for quantization in (None, "int8"):
        loaded = load_model(save_hf_model(ARCHITECTURES["qwen3-qk-norm"]()))
        if quantization:
            quantize_model(loaded.model, get_quantization_method(quantization))
        runners = paged_runner(loaded.model, loaded.config), paged_runner(loaded.model, loaded.config)
        models.append((runners, CompiledDecode(loaded.model, runners[1].kv_caches, None),
                       1e-3 if quantization else 1e-5))  # int8: activations rounded to int16 per row
    gen = torch.Generator().manual_seed(5)
    prompts = {i: torch.randint(3, VOCAB, (n,), generator=gen).tolist() for i, n in enumerate(PROMPT_LENS)}
    for (eager, compiled_runner), _, _ in models:
        for runner in (eager, compiled_runner):
            runner.step(list(prompts.items()))
    for step in range(2):
        for (eager, compiled_runner), compiled, tolerance in models:
            batch = [(i, [step + 3]) for i in prompts]
            expected = eager.step(batch)
            ours = compiled_runner.step(batch, forward=compiled.forward)
            torch.testing.assert_close(torch.cat(ours), torch.cat(expected), atol=tolerance, rtol=tolerance)


def test_batch_invariant_mode_compiles_the_graphs_before_serving(save_hf_model, monkeypatch) -> None:
    """serve's default (None) compiles while the engine is idle, its steps eager until then;
    where rows are routed batch-invariantly, a step must not run eager for want of a graph
    (its low bits would differ), so the graphs compile before the engine serves."""
    path = save_hf_model(ARCHITECTURES["qwen3-qk-norm"]())
    compiled_sizes = []

    def compile_next(self):  # the order of the compiles is under test, not the compile
        if not self._pending:
            return False
        compiled_sizes.append(self._pending.pop(0))
        return True

    monkeypatch.setattr(CompiledDecode, "compile_next", compile_next)
    engine = dict(model=path, quantization="int8", kv_cache_memory="16MiB", compile_decode=None)
    invariant = LLMEngine(EngineArgs(**engine, batch_invariant=True)).core.runner
    assert invariant.batch_invariant and invariant.compiled_decode.pending == 0 and compiled_sizes == [1, 2]
    per_batch_size = LLMEngine(EngineArgs(**engine, batch_invariant=False)).core.runner
    assert per_batch_size.compiled_decode.pending == 2 and compiled_sizes == [1, 2]


# Compiles the decode graphs of an int8 model whose layers keep their kernel up to 4 rows
# (bands 1, 2-4, 5-16) or, "invariant", always (bands 1, 2-16), then runs every row count:
# prints how many graphs those runs compiled.
_BANDS_THEN_EVERY_ROW_COUNT = """
import sys
import torch
from torch._dynamo.utils import counters
from kvserve.engine.engine_args import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.model_executor.compiled_decode import MAX_ROWS, CompiledDecode
from kvserve.quantization.base import QuantizedLinear

runner = LLMEngine(EngineArgs(model=sys.argv[1], quantization="int8", kv_cache_memory="16MiB")).core.runner
for module in runner.model.modules():
    if isinstance(module, QuantizedLinear):
        module.keep_dense_weight(kernel_max_rows=4)
        module.batch_invariant = sys.argv[2] == "invariant"
compiled = CompiledDecode(runner.model, runner.kv_caches, None)
compiled.warm_up()
before = counters["stats"]["unique_graphs"]
for rows in range(1, MAX_ROWS + 1):
    compiled._run_placeholder(rows)
print("compiled after warm-up:", counters["stats"]["unique_graphs"] - before)
"""


def test_each_band_compiles_at_its_largest_row_count_then_runs_its_smallest(save_hf_model, monkeypatch) -> None:
    """What keeps a graph another plan cached for a narrower band from being the one a band
    gets (the slow test below shows the recompile that follows): the first compile of a band
    is at its largest row count, the second run at its smallest; a one-row band runs once."""
    from kvserve.quantization import get_quantization_method, quantize_model
    from kvserve.quantization.base import QuantizedLinear

    loaded = load_model(save_hf_model(ARCHITECTURES["qwen3-qk-norm"]()))
    quantize_model(loaded.model, get_quantization_method("int8"))
    for module in loaded.model.modules():
        if isinstance(module, QuantizedLinear):
            module.keep_dense_weight(kernel_max_rows=4)
    runs = []
    monkeypatch.setattr(CompiledDecode, "_run_placeholder", lambda self, rows: runs.append(rows))
    compiled = CompiledDecode(loaded.model, [], None)
    compiled.warm_up()
    assert runs == [1, 4, 2, 16, 5] and compiled.pending == 0


@pytest.mark.slow
def test_a_graph_cached_for_a_narrower_band_does_not_compile_again_mid_serving(save_hf_model, tmp_path) -> None:
    """The same ops for rows 2-4 under one plan and 2-16 under another are one graph to AOT
    autograd's on-disk cache, kept with the first plan's guards (rows <= 4): a band warmed up at
    its smallest row count took that graph and compiled again at its first step of 5 rows,
    while serving. Two processes sharing a fresh cache, as two starts of a server."""
    import os
    import subprocess
    import sys

    path = save_hf_model(ARCHITECTURES["qwen3-qk-norm"]())
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    for plan in ("per-row-count", "invariant"):
        run = subprocess.run([sys.executable, "-c", _BANDS_THEN_EVERY_ROW_COUNT, path, plan], env=env,
                             capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        assert run.stdout.strip().splitlines()[-1] == "compiled after warm-up: 0", (plan, run.stdout[-500:])
