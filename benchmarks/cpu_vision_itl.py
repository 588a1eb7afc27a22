"""Do image requests slow concurrent text-only streams on a CPU? A small random Qwen2-VL
(built here from transformers' config class) serves --streams text-only streams; once they
decode, --image-requests requests with --images-per-request random-noise images each
arrive. Every engine step is timed: the text streams' inter-token latency is the step
time. Reported per configuration: steps with only decodes; steps that ran the vision
encoder (alone beside the decodes, or beside prompt tokens too); steps that prefilled
prompt tokens without encoding; and, for scale, text-only prefills as long as a full chunk.
The ratio the target bounds is encoding steps over decode-only steps.

A/B in one process on one copy of the weights: the tower spread over steps
(--encoder-budget-per-step, default the CPU default) against whole images per step (0),
with the same requests and images, the two engines' steps alternating one for one so both
see the same machine load.

    PYTHONPATH=. python benchmarks/cpu_vision_itl.py [--image-size 448] [--budget 512]
        [--encoder-budget 256] [--rounds 2] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import torch
from PIL import Image
from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessor

from kvserve import SamplingParams
from kvserve.engine.core import load_engine_model
from kvserve.engine.engine_args import CPU_ENCODER_BUDGET_PER_STEP, EngineArgs
from kvserve.engine.llm_engine import LLMEngine

IMAGE_PAD, VISION_START, VISION_END = 1000, 1001, 1002


def build_model(directory: str, image_size: int) -> None:
    config = Qwen2VLConfig(
        vision_config={"depth": 4, "embed_dim": 128, "hidden_size": 256, "num_heads": 4, "mlp_ratio": 4,
                       "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
        text_config={"vocab_size": 1024, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "bos_token_id": 1, "eos_token_id": 2,
                     "rope_parameters": {"rope_type": "default", "mrope_section": [8, 12, 12],
                                         "rope_theta": 10000.0}},
        image_token_id=IMAGE_PAD, video_token_id=1003, vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END)
    torch.manual_seed(0)
    Qwen2VLForConditionalGeneration(config).save_pretrained(directory)
    Qwen2VLImageProcessor(min_pixels=28 * 28, max_pixels=image_size * image_size).save_pretrained(directory)


def run_round(engine: LLMEngine, args: argparse.Namespace, rng: np.random.Generator, tag: str,
              steps: list[tuple[str, float, float]]) -> Iterator[None]:
    """One scenario: text streams decode, image requests arrive, then two chunk-long text
    prompts; every step timed and classified into `steps`. Yields after each timed step,
    so that two configurations' steps can alternate."""
    text = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)
    streams = [f"{tag}-text-{i}" for i in range(args.streams)]
    for request_id in streams:
        engine.add_request(request_id, list(rng.integers(10, 900, 32).tolist()), text)
    scheduler = engine.core.scheduler
    while any(seq.num_computed_tokens < seq.num_prompt_tokens for seq in scheduler.running) or scheduler.waiting:
        engine.step()
    for _ in range(5):  # warm decode steps
        engine.step()

    runner = engine.core.runner

    def timed_step(kind_if_plain: str) -> None:
        encoded, units = runner.encoder_cache.num_images_encoded, runner.sliced_encoder.num_units_run
        encoder_seconds = runner.encoder_cache.encoder_seconds
        prefilling = {seq.seq_id for seq in scheduler.running if seq.num_computed_tokens < seq.num_prompt_tokens}
        scheduled: dict[str, int] = {}
        execute = runner.execute

        def recording(sched):
            scheduled.update(sched.num_scheduled_tokens)
            return execute(sched)

        runner.execute = recording
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        runner.execute = execute
        prompt_tokens = sum(n for seq_id, n in scheduled.items() if seq_id in prefilling or n > 1)
        encoding = runner.encoder_cache.num_images_encoded > encoded or runner.sliced_encoder.num_units_run > units
        if encoding:
            kind = "encoding + prefill" if prompt_tokens else "encoding"
        else:
            kind = "image prefill" if prompt_tokens and kind_if_plain == "decode" else kind_if_plain
        steps.append((kind, elapsed, runner.encoder_cache.encoder_seconds - encoder_seconds))

    for _ in range(20):
        timed_step("decode")
        yield
    image_params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    images_ids = [f"{tag}-image-{i}" for i in range(args.image_requests)]
    for request_id in images_ids:
        images = [Image.fromarray(rng.integers(0, 256, (args.image_size, args.image_size, 3), dtype=np.uint8))
                  for _ in range(args.images_per_request)]
        prompt = [1, 20, 21] + [VISION_START, IMAGE_PAD, VISION_END] * args.images_per_request + [30, 31]
        engine.add_request(request_id, {"prompt_token_ids": prompt, "multi_modal_data": {"image": images}},
                           image_params)
    while any(r in engine.requests for r in images_ids):
        timed_step("decode")
        yield
    # For scale: text-only prompts as long as a full prefill chunk.
    long_ids = [f"{tag}-long-{i}" for i in range(2)]
    for request_id in long_ids:
        engine.add_request(request_id, list(rng.integers(10, 900, args.budget).tolist()),
                           SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    while any(r in engine.requests for r in long_ids):
        timed_step("text prefill")
        yield
    for request_id in streams:
        engine.abort_request(request_id)


def report(label: str, steps: list[tuple[str, float, float]]) -> dict[str, list[float]]:
    """Step times per kind, and (for scale against the step) the encoder's own time in it."""
    by_kind: dict[str, list[float]] = {}
    encoder_ms: dict[str, list[float]] = {}
    for kind, elapsed, encoder in steps:
        by_kind.setdefault(kind, []).append(elapsed * 1e3)
        encoder_ms.setdefault(kind, []).append(encoder * 1e3)
    decode_median = statistics.median(by_kind["decode"])
    print(label)
    print(f"{'steps':>20} {'n':>4} {'median ms':>10} {'max ms':>8} {'median / decode':>16} {'p99 / decode':>13} "
          f"{'max / decode':>13} {'encoder median ms':>18}")
    for kind, times in by_kind.items():
        p99 = float(np.percentile(times, 99))
        print(f"{kind:>20} {len(times):>4} {statistics.median(times):>10.2f} {max(times):>8.2f} "
              f"{statistics.median(times) / decode_median:>16.2f} {p99 / decode_median:>13.2f} "
              f"{max(times) / decode_median:>13.2f} {statistics.median(encoder_ms[kind]):>18.2f}")
    return by_kind


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=4, help="Text-only streams (default 4).")
    parser.add_argument("--image-requests", type=int, default=4, help="Requests with images (default 4).")
    parser.add_argument("--images-per-request", type=int, default=2, help="Images in each (default 2).")
    parser.add_argument("--image-size", type=int, default=448, help="Square image side in pixels (default 448).")
    parser.add_argument("--budget", type=int, default=512, help="--max-num-batched-tokens (default 512, CPU's).")
    parser.add_argument("--encoder-budget", type=int, default=CPU_ENCODER_BUDGET_PER_STEP,
                        help=f"--encoder-budget-per-step of the sliced engine (default {CPU_ENCODER_BUDGET_PER_STEP}).")
    parser.add_argument("--rounds", type=int, default=2, help="Rounds per configuration, interleaved (default 2).")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default torch's); 1 keeps a loaded shared machine's time "
                        "slicing out of every op's thread barrier.")
    parser.add_argument("--output-json", default=None, help="Write the step times here.")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    directory = tempfile.mkdtemp()
    build_model(directory, args.image_size)
    configs = {"sliced": args.encoder_budget, "whole": 0}
    base = EngineArgs(model=directory, skip_tokenizer_init=True, kv_cache_memory="256MiB", max_model_len=4096,
                      max_num_batched_tokens=args.budget, enable_prefix_caching=False)
    loaded = load_engine_model(base)
    engines = {label: LLMEngine(replace(base, encoder_budget_per_step=budget), loaded)
               for label, budget in configs.items()}
    steps: dict[str, list[tuple[str, float, float]]] = {label: [] for label in configs}
    for round_index in range(args.rounds):
        # The same requests and images for both; their steps alternate one for one.
        rounds = [run_round(engine, args, np.random.default_rng(round_index), f"{label}-{round_index}", steps[label])
                  for label, engine in engines.items()]
        while rounds:
            rounds = [r for r in rounds if next(r, StopIteration) is not StopIteration]

    print(f"{args.streams} text streams, {args.image_requests} requests x {args.images_per_request} images "
          f"{args.image_size}x{args.image_size}, budget {args.budget} tokens, {args.rounds} rounds, the two "
          f"configurations' steps alternating, {torch.get_num_threads()} torch threads")
    results = {}
    for label, engine in engines.items():
        cache = engine.core.runner.encoder_cache
        results[label] = report(
            f"\n{label}: --encoder-budget-per-step {configs[label]}; encoder {cache.encoder_seconds:.3f} s for "
            f"{cache.num_images_encoded} images", steps[label])
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "steps_ms": results}, f, indent=2)


if __name__ == "__main__":
    main()
