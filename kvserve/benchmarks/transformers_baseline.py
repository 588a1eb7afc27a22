"""The transformers side of a side-by-side run: the same random-weight shapes as
`--load-format dummy --model-shape S`, through `generate` (W2: one batch of identical
requests) and `generate_batch` (W1: transformers' own continuous batching).

    python -m kvserve.benchmarks.transformers_baseline --model-shape llama3-8b --w2 --w1
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from kvserve.benchmarks.throughput import make_requests
from kvserve.model_executor.dummy import dummy_model_config


@dataclass
class HfLatencyResult:
    batch_size: int
    input_len: int
    output_len: int
    ttft_ms: float
    tpot_ms: float


@dataclass
class HfThroughputResult:
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    elapsed_s: float
    output_tok_s: float
    note: str


def build_hf_model(shape: str, device: torch.device, dtype: torch.dtype, attn_implementation: str):
    """A transformers model with our dummy shape's config, Normal(0, 0.02) weights."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    config = dummy_model_config(shape)
    common = dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta, max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings, bos_token_id=config.bos_token_id,
        eos_token_id=None, pad_token_id=0,
    )
    if config.architecture == "Qwen2ForCausalLM":
        hf_config = Qwen2Config(**common)
    else:
        hf_config = LlamaConfig(**common, head_dim=config.head_dim, rope_scaling=config.rope_scaling)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            hf_config, dtype=dtype, attn_implementation=attn_implementation
        )
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.fill_(1.0) if "norm" in name else param.normal_(0.0, 0.02)
    return model.eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_generate(model, batch_size: int, input_len: int, output_len: int, seed: int = 0) -> HfLatencyResult:
    """TTFT from a 1-token generate, TPOT from the full one: (full - first) / (out - 1)."""
    device = model.device
    requests = make_requests(batch_size, (input_len, input_len), (output_len, output_len),
                             model.config.vocab_size, seed)
    ids = torch.tensor([r.prompt_token_ids for r in requests], device=device)

    def timed(new_tokens: int) -> float:
        _sync(device)
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
        _sync(device)
        assert out.shape[1] == input_len + new_tokens
        return time.perf_counter() - start

    with torch.inference_mode():
        timed(2)  # warm up
        first = statistics.median(timed(1) for _ in range(3))
        full = timed(output_len)
    return HfLatencyResult(batch_size, input_len, output_len, first * 1e3,
                           (full - first) / (output_len - 1) * 1e3)


def run_generate_batch(model, num_requests: int, input_len: tuple[int, int],
                       output_len: tuple[int, int], seed: int = 0) -> HfThroughputResult:
    """generate_batch takes one max_new_tokens for all requests: W1's mean output length."""
    from transformers import GenerationConfig

    requests = make_requests(num_requests, input_len, output_len, model.config.vocab_size, seed)
    new_tokens = round(statistics.mean(r.output_len for r in requests))
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
    inputs = [r.prompt_token_ids for r in requests]
    model.generate_batch(inputs=inputs[:4], generation_config=config, progress_bar=False)  # warm up
    _sync(model.device)
    start = time.perf_counter()
    outputs = model.generate_batch(inputs=inputs, generation_config=config, progress_bar=False)
    _sync(model.device)
    elapsed = time.perf_counter() - start
    output_tokens = sum(len(o.generated_tokens) for o in outputs.values())
    return HfThroughputResult(
        len(requests), sum(len(p) for p in inputs), output_tokens, elapsed,
        output_tokens / elapsed, f"one output length ({new_tokens}) for all requests",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-shape", required=True, help="llama3-8b, qwen2.5-0.5b or smollm2-135m.")
    parser.add_argument("--device", default="cuda", help="Device of the model.")
    parser.add_argument("--w2", action="store_true", help="Run W2 through generate.")
    parser.add_argument("--w2-batch-sizes", default="1", help="Comma-separated W2 batch sizes.")
    parser.add_argument("--w1", action="store_true", help="Run W1 through generate_batch.")
    parser.add_argument("--w1-num-prompts", type=int, default=256, help="W1 request count.")
    parser.add_argument("--output-json", default=None, help="Write the results to this file.")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    results: dict[str, object] = {"model_shape": args.model_shape}
    if args.w2:
        model = build_hf_model(args.model_shape, device, dtype, "sdpa")
        w2 = [run_generate(model, int(b), 128, 256) for b in args.w2_batch_sizes.split(",")]
        results["w2_generate"] = [asdict(r) for r in w2]
        for r in w2:
            print(f"transformers generate {args.model_shape} batch {r.batch_size}: "
                  f"TTFT {r.ttft_ms:.1f} ms, TPOT {r.tpot_ms:.2f} ms")
        del model
    if args.w1:
        model = build_hf_model(args.model_shape, device, dtype, "paged|sdpa")
        w1 = run_generate_batch(model, args.w1_num_prompts, (100, 1024), (100, 1024))
        results["w1_generate_batch"] = asdict(w1)
        print(f"transformers generate_batch {args.model_shape} W1 ({w1.num_requests} requests, "
              f"{w1.note}): {w1.output_tok_s:.0f} out tok/s in {w1.elapsed_s:.1f} s")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
