"""The engine on a GPU (torch reference attention): greedy output equals transformers'."""

from __future__ import annotations

import gc

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
)

from kvserve import LLM, SamplingParams

pytestmark = pytest.mark.gpu


def _transformers_greedy(reference, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt alone, on the GPU."""
    continuations = []
    with torch.inference_mode():
        for ids in prompts:
            input_ids = torch.tensor([ids], device="cuda")
            out = reference.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                     do_sample=False, max_new_tokens=new_tokens,
                                     min_new_tokens=new_tokens, pad_token_id=0)
            continuations.append(out[0, len(ids):].tolist())
    return continuations


def test_greedy_matches_transformers_on_gpu(save_hf_model):
    config = LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
    )
    reference = LlamaForCausalLM(config)
    model_dir = save_hf_model(reference)
    reference = reference.cuda().eval()

    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=generator).tolist() for n in (5, 17, 33, 64, 100)]
    expected = _transformers_greedy(reference, prompts, 32)

    llm = LLM(model=model_dir, dtype="float32", device="cuda", max_num_batched_tokens=64,
              gpu_memory_utilization=0.5)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts],
                           SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outputs] == expected


_MOE_SHAPE = dict(vocab_size=512, hidden_size=256, num_hidden_layers=3, num_attention_heads=8,
                  num_key_value_heads=2, max_position_embeddings=1024, num_experts_per_tok=2)
MIXTURES = {
    "mixtral": lambda: MixtralForCausalLM(MixtralConfig(
        **_MOE_SHAPE, intermediate_size=384, num_local_experts=8, sliding_window=None)),
    "qwen2-moe": lambda: Qwen2MoeForCausalLM(Qwen2MoeConfig(
        **_MOE_SHAPE, intermediate_size=384, moe_intermediate_size=192, num_experts=8,
        shared_expert_intermediate_size=320, mlp_only_layers=[1])),
}


@pytest.mark.parametrize("architecture", sorted(MIXTURES))
def test_mixture_of_experts_greedy_matches_transformers_on_gpu(save_hf_model, architecture):
    """Sparse experts on the GPU: the fused experts (pair GEMVs and grouped GEMMs) captured in
    CUDA graphs, Triton attention."""
    reference = MIXTURES[architecture]()
    model_dir = save_hf_model(reference)
    reference = reference.cuda().eval()
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 512, (n,), generator=generator).tolist() for n in (7, 30, 61)]
    expected = _transformers_greedy(reference, prompts, 24)

    llm = LLM(model=model_dir, dtype="float32", device="cuda", max_num_batched_tokens=64,
              gpu_memory_utilization=0.5)
    assert llm.engine.core.runner.cuda_graphs is not None
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts],
                           SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_triton_backend_greedy_equals_torch_reference(save_hf_model):
    """A mixed batch (prefix-cache hits, chunked prefill, decodes) through both backends."""
    config = LlamaConfig(
        vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
    )
    model_dir = save_hf_model(LlamaForCausalLM(config))
    generator = torch.Generator().manual_seed(1)
    shared = torch.randint(3, 1024, (40,), generator=generator).tolist()
    prompts = [shared + torch.randint(3, 1024, (n,), generator=generator).tolist()
               for n in (1, 9, 30, 77, 300)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    results = {}
    for backend in ("torch", "triton"):
        llm = LLM(model=model_dir, dtype="float32", device="cuda", attention_backend=backend,
                  max_num_batched_tokens=96, gpu_memory_utilization=0.3)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        results[backend] = [o.outputs[0].token_ids for o in outputs]
        assert llm.engine.core.scheduler.prefix_cache_stats.hit_tokens > 0
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert results["triton"] == results["torch"]


@pytest.mark.parametrize(("num_prompts", "dtype"), [(5, "float32"), (13, "float32"), (2, "bfloat16")])
def test_cuda_graph_decode_equals_eager(save_hf_model, num_prompts, dtype):
    """Decode steps replayed from CUDA graphs (batch padded to a bucket; long contexts
    take a split-KV graph, and in bf16 one or two short contexts the short-tile plans; all
    graphs share one logits buffer) give the eager path's tokens and logprobs."""
    from kvserve.ops.attention.paged_attention import SHORT_DECODE_TILE

    config = LlamaConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
    )
    model_dir = save_hf_model(LlamaForCausalLM(config))
    generator = torch.Generator().manual_seed(2)
    lengths = [3, 40, 129, 700, 1500][:num_prompts] + [17 * i for i in range(1, num_prompts - 4)]
    if dtype == "bfloat16":
        lengths = [129, 700]
    prompts = [torch.randint(3, 1024, (n,), generator=generator).tolist() for n in lengths]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=3)
    results = {}
    for eager in (True, False):
        llm = LLM(model=model_dir, dtype=dtype, device="cuda", enforce_eager=eager,
                  max_num_seqs=16, gpu_memory_utilization=0.3)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        results[eager] = outputs
        graphs = llm.engine.core.runner.cuda_graphs
        if eager:
            assert graphs is None
        else:
            assert graphs.num_replays > 0
            assert any(plan.num_kv_splits > 1 for _, _, plan in graphs.graphs)
            # Every graph writes its logits into the runner's one buffer.
            assert {graph.logits.data_ptr() for graph in graphs.graphs.values()} == {graphs.logits.data_ptr()}
            # The last step (both bf16 prompts, 740 keys) replayed a short-tile plan.
            assert (graphs.last_key[2].tile == SHORT_DECODE_TILE) == (dtype == "bfloat16")
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    for graph_out, eager_out in zip(results[False], results[True]):
        assert graph_out.outputs[0].token_ids == eager_out.outputs[0].token_ids
        for graph_lp, eager_lp in zip(graph_out.outputs[0].logprobs, eager_out.outputs[0].logprobs):
            assert graph_lp.keys() == eager_lp.keys()
            for token in graph_lp:
                assert graph_lp[token] == pytest.approx(eager_lp[token], abs=1e-3)


def test_fp8_kv_cache_triton_equals_torch_reference(save_hf_model):
    """A float8 cache (calibrated scales) read by the Triton kernels gives the torch
    reference's greedy tokens: same scales, same saturating round-to-nearest stores."""
    config = LlamaConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
    )
    model_dir = save_hf_model(LlamaForCausalLM(config))
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 1024, (n,), generator=generator).tolist() for n in (7, 90, 600)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    results = {}
    for backend in ("torch", "triton"):
        llm = LLM(model=model_dir, dtype="float32", device="cuda", attention_backend=backend,
                  kv_cache_dtype="fp8", gpu_memory_utilization=0.3)
        assert llm.engine.core.runner.kv_caches[0].dtype == torch.float8_e4m3fn
        results[backend] = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params)]
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert results["triton"] == results["torch"]


@pytest.mark.parametrize("eager", [False, True])
def test_overlap_scheduling_equals_one_step_at_a_time(save_hf_model, eager):
    """Decode steps launched before the previous step's tokens are read (inputs taken from
    the device) give the same tokens and finish reasons, with stops that end sequences
    while a step ahead is in flight and requests that arrive in between."""
    config = LlamaConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
    )
    model_dir = save_hf_model(LlamaForCausalLM(config))
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 1024, (n,), generator=generator).tolist()
               for n in (3, 40, 129, 700, 17, 64)]

    def run(params: list[SamplingParams], overlap: bool) -> tuple[list, int]:
        llm = LLM(model=model_dir, dtype="float32", device="cuda", enforce_eager=eager,
                  max_num_seqs=16, gpu_memory_utilization=0.3, overlap_scheduling=overlap)
        engine = llm.engine
        for i in range(4):
            engine.add_request(f"r{i}", {"prompt_token_ids": prompts[i]}, params[i])
        finals, steps = {}, 0
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    finals[output.request_id] = [
                        (c.token_ids, c.finish_reason) for c in output.outputs]
            steps += 1
            if steps == 5:
                for i in (4, 5):
                    engine.add_request(f"r{i}", {"prompt_token_ids": prompts[i]}, params[i])
        assert engine.core.kv_cache.num_free_blocks == engine.core.runner.num_blocks
        ahead = engine.core.num_steps_ahead
        del llm, engine
        gc.collect()
        torch.cuda.empty_cache()
        return [finals[f"r{i}"] for i in range(len(prompts))], ahead

    greedy = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)] * len(prompts)
    first, _ = run(greedy, overlap=False)
    # Stop tokens that end three sequences part-way (the token greedy decoding makes 8th).
    params = [
        SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[first[0][0][0][7]]),
        SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=26, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[first[2][0][0][7]]),
        SamplingParams(temperature=1.0, seed=4, n=2, max_tokens=19, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[first[4][0][0][7]]),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    ]
    reference, none_ahead = run(params, overlap=False)
    overlapped, ahead = run(params, overlap=True)
    assert overlapped == reference
    assert none_ahead == 0 and ahead >= 10
    assert sum(c[1] == "stop" for outs in reference for c in outs) >= 3


def test_latency_times_each_served_decode_graph():
    """bench latency's served-graph timing: one (start, end) event pair per graph replay of
    the run, each a positive device time no longer than the wall time of a step, and the
    runner back to untimed replays afterwards. With the prefill split over steps (8 prompts
    of 24 tokens, 64 a step) the last steps run fewer sequences: "GPU ms" replays the whole
    batch's graph, not the last one."""
    from kvserve.benchmarks.latency import run_latency

    llm = LLM(load_format="dummy", model_shape="smollm2-135m", device="cuda", gpu_memory_utilization=0.3,
              max_num_batched_tokens=64)
    graphs = llm.engine.core.runner.cuda_graphs
    replays = graphs.num_replays
    result = run_latency(llm, batch_size=8, input_len=24, output_len=12, bandwidth=1e12)
    assert graphs.replay_events is None and graphs.num_replays > replays
    assert result.served_graph_ms is not None and 0 < result.served_graph_ms <= result.step_ms_max
    assert graphs.last_key[0] < 8 and graphs.replays.most_common(1)[0][0][0] == 8
    assert result.gpu_step_ms is not None and 0 < result.gpu_step_ms
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def test_wide_short_decode_plan_scores_like_the_wide_tile(save_hf_model, monkeypatch):
    """64 sequences over at most 384 keys (bf16 cache) decode on the 32-key tile unsplit, with
    RoPE and the KV write inside the attention (choose_decode_plan). Each run's decode
    logprobs are scored against the teacher-forced logprobs of the tokens it chose (prefill
    rows, never the decode plans): the new plan's run is as close as the wide tile's."""
    from kvserve.ops.attention import paged_attention
    from kvserve.ops.attention.paged_attention import SHORT_DECODE_TILE

    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
    model_dir = save_hf_model(LlamaForCausalLM(config).to(torch.bfloat16))
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 512, (20 + 5 * i,), generator=generator).tolist() for i in range(64)]
    batch_size = paged_attention.WIDE_SHORT_BATCH

    def decode(short_tile: bool) -> list[tuple[list[int], list[float]]]:
        monkeypatch.setattr(paged_attention, "WIDE_SHORT_BATCH", batch_size if short_tile else 10**9)
        llm = LLM(model=model_dir, dtype="bfloat16", device="cuda", max_num_seqs=64, gpu_memory_utilization=0.3)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0))
        graphs = llm.engine.core.runner.cuda_graphs
        took_short = any(bucket == 64 and plan == paged_attention.DecodePlan(1, SHORT_DECODE_TILE)
                         for bucket, _, plan in graphs.replays)
        assert took_short == short_tile
        del llm
        gc.collect()
        torch.cuda.empty_cache()
        return [(o.outputs[0].token_ids, [entry[t] for t, entry in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
                for o in outputs]

    runs = {short: decode(short) for short in (True, False)}
    reference = LLM(model=model_dir, dtype="bfloat16", device="cuda", gpu_memory_utilization=0.3)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)

    def error(run) -> float:
        scored = reference.generate([{"prompt_token_ids": prompt + tokens} for prompt, (tokens, _) in zip(prompts, run)],
                                    params)
        diffs = []
        for prompt, (tokens, logprobs), out in zip(prompts, run, scored, strict=True):
            forced = [entry[t] for t, entry in zip(out.prompt_token_ids[len(prompt):], out.prompt_logprobs[len(prompt):])]
            diffs += [abs(a - b) for a, b in zip(logprobs, forced, strict=True)]
        return sum(diffs) / len(diffs)

    short_error, wide_error = error(runs[True]), error(runs[False])
    print(f"mean |decode logprob - teacher-forced|: 32-key tile {short_error:.4f}, wide tile {wide_error:.4f}")
    assert short_error <= 2 * wide_error + 2e-3
