"""Do image requests slow concurrent text-only streams on a CPU? A small random Qwen2-VL
(built here from transformers' config class) serves --streams text-only streams; once they
decode, --image-requests requests with --images-per-request random-noise images each
arrive. Every engine step is timed: the text streams' inter-token latency is the step
time. Reported: steps with only decodes; steps that ran the vision encoder; steps that
prefilled image tokens without encoding; and, for scale, a text-only prefill of the same
chunk size. The ratio the target bounds is encoding steps over decode-only steps.

    PYTHONPATH=. python benchmarks/cpu_vision_itl.py [--image-size 448] [--budget 512]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import numpy as np
import torch
from PIL import Image
from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessor

from kvserve import SamplingParams
from kvserve.engine.engine_args import EngineArgs
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=4, help="Text-only streams (default 4).")
    parser.add_argument("--image-requests", type=int, default=4, help="Requests with images (default 4).")
    parser.add_argument("--images-per-request", type=int, default=2, help="Images in each (default 2).")
    parser.add_argument("--image-size", type=int, default=448, help="Square image side in pixels (default 448).")
    parser.add_argument("--budget", type=int, default=512, help="--max-num-batched-tokens (default 512, CPU's).")
    parser.add_argument("--output-json", default=None, help="Write the step times here.")
    args = parser.parse_args()

    directory = tempfile.mkdtemp()
    build_model(directory, args.image_size)
    engine = LLMEngine(EngineArgs(model=directory, skip_tokenizer_init=True, kv_cache_memory="512MiB",
                                  max_model_len=4096, max_num_batched_tokens=args.budget,
                                  enable_prefix_caching=False))
    rng = np.random.default_rng(0)
    text = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    for i in range(args.streams):
        engine.add_request(f"text-{i}", list(rng.integers(10, 900, 32).tolist()), text)
    while any(seq.num_computed_tokens < seq.num_prompt_tokens for seq in engine.core.scheduler.running) \
            or engine.core.scheduler.waiting:
        engine.step()
    for _ in range(5):  # warm decode steps
        engine.step()

    cache = engine.core.runner.encoder_cache
    steps: list[tuple[str, float]] = []

    def timed_step(kind_if_plain: str) -> None:
        encoded = cache.num_images_encoded
        images_running = any(seq.mm_features and seq.num_computed_tokens < seq.num_prompt_tokens
                             for seq in engine.core.scheduler.running)
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        kind = "encoding" if cache.num_images_encoded > encoded else (
            "image prefill" if images_running else kind_if_plain)
        steps.append((kind, elapsed))

    for _ in range(20):
        timed_step("decode")
    image_params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for i in range(args.image_requests):
        images = [Image.fromarray(rng.integers(0, 256, (args.image_size, args.image_size, 3), dtype=np.uint8))
                  for _ in range(args.images_per_request)]
        prompt = [1, 20, 21] + [VISION_START, IMAGE_PAD, VISION_END] * args.images_per_request + [30, 31]
        engine.add_request(f"image-{i}", {"prompt_token_ids": prompt, "multi_modal_data": {"image": images}},
                           image_params)
    while any(r.startswith("image") for r in engine.requests):
        timed_step("decode")
    # For scale: text-only prompts as long as a full prefill chunk.
    for i in range(2):
        engine.add_request(f"long-{i}", list(rng.integers(10, 900, args.budget).tolist()),
                           SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    while any(r.startswith("long") for r in engine.requests):
        timed_step("text prefill")

    by_kind: dict[str, list[float]] = {}
    for kind, elapsed in steps:
        by_kind.setdefault(kind, []).append(elapsed * 1e3)
    decode_median = statistics.median(by_kind["decode"])
    print(f"{args.streams} text streams, {args.image_requests} requests x {args.images_per_request} images "
          f"{args.image_size}x{args.image_size}, budget {args.budget} tokens; encoder {cache.encoder_seconds:.3f} s "
          f"for {cache.num_images_encoded} images")
    print(f"{'steps':>14} {'n':>4} {'median ms':>10} {'max ms':>8} {'max / decode median':>20}")
    for kind, times in by_kind.items():
        print(f"{kind:>14} {len(times):>4} {statistics.median(times):>10.2f} {max(times):>8.2f} "
              f"{max(times) / decode_median:>20.2f}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "steps_ms": by_kind}, f, indent=2)


if __name__ == "__main__":
    main()
