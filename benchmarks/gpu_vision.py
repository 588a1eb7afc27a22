"""Vision-language serving on one GPU, kvserve beside transformers in the same process.

1. TTFT of one request, a WxH image plus --text-tokens text tokens, from the PIL image to
   the first sampled token: kvserve's `LLM.generate` (max_tokens=1) against transformers'
   image processor + `generate(max_new_tokens=1)` on the same architecture with random
   weights (sdpa attention). Every trial uses a new image, so neither the encoder cache nor
   the prefix cache can help; the two alternate trial by trial. kvserve's vision-encoder
   share of its TTFT is reported from its encoder timer.
2. Throughput: --requests concurrent requests, each with its own image, --output-len
   tokens each, against the same number of text-only requests whose prompts are as long
   as the image requests' (placeholders expanded), both on kvserve.

Random weights in the model's real shape (`--model-shape qwen2.5-vl-7b`, dummy); or
`--model DIR`, a Hugging Face directory, to try the script on a small model.

    PYTHONPATH=. python benchmarks/gpu_vision.py --model-shape qwen2.5-vl-7b \\
        [--image-size 1024] [--text-tokens 64] [--trials 5] [--requests 64] [--output-len 128]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch
from PIL import Image

from kvserve import LLM, SamplingParams


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_image(size: int, seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def hf_model_and_processor(args: argparse.Namespace, llm: LLM, device: torch.device, dtype: torch.dtype):
    """transformers' model of the same architecture (random Normal(0, 0.02) weights for a
    named shape, the directory's weights otherwise) and the image processor kvserve uses."""
    import transformers

    config_dict = llm.engine.core.model_config.hf_config
    architecture = config_dict["architectures"][0]
    model_class = getattr(transformers, architecture)
    if args.model is not None:
        model = model_class.from_pretrained(args.model, dtype=dtype, attn_implementation="sdpa").to(device)
    else:
        config = transformers.AutoConfig.for_model(**config_dict)
        with torch.device(device):
            model = model_class._from_config(config, dtype=dtype, attn_implementation="sdpa")
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.fill_(1.0) if "norm" in name else param.normal_(0.0, 0.02)
    return model.eval(), llm.engine.image_processing.image_processor


def text_id_range(vocab_size: int) -> tuple[int, int]:
    """Ordinary text ids: below the special tokens at the top of the vocabulary."""
    return 10, min(vocab_size - 16, 150_000)


def placeholder_prompt(config_dict: dict, text_tokens: int, vocab_size: int) -> list[int]:
    """Qwen2-VL's vision start, image pad and vision end, then text ids."""
    low, high = text_id_range(vocab_size)
    return [config_dict["vision_start_token_id"], config_dict["image_token_id"],
            config_dict["vision_end_token_id"], *(low + i % (high - low) for i in range(text_tokens))]


def kvserve_ttft(llm: LLM, prompt: list[int], image: Image.Image, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    llm.generate({"prompt_token_ids": prompt, "multi_modal_data": {"image": image}},
                 SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    _sync(device)
    return time.perf_counter() - start


@torch.inference_mode()
def hf_ttft(model, processor, prompt: list[int], image: Image.Image, image_token_id: int,
            device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    processed = processor(images=[image], return_tensors="pt")
    grid = processed["image_grid_thw"]
    num_image_tokens = int(grid.prod()) // processor.merge_size**2
    expanded = [t for token in prompt for t in ([token] * num_image_tokens if token == image_token_id else [token])]
    input_ids = torch.tensor([expanded], device=device)
    model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                   mm_token_type_ids=(input_ids == image_token_id).int(),
                   pixel_values=processed["pixel_values"].to(device, model.dtype), image_grid_thw=grid.to(device),
                   max_new_tokens=1, do_sample=False, eos_token_id=None, pad_token_id=0)
    _sync(device)
    return time.perf_counter() - start


def throughput(llm: LLM, requests: list, output_len: int, device: torch.device) -> dict[str, float]:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    _sync(device)
    start = time.perf_counter()
    outputs = llm.generate(requests, params, use_tqdm=False)
    _sync(device)
    seconds = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return {"seconds": seconds, "output_tok_s": generated / seconds,
            "total_tok_s": (generated + prompt_tokens) / seconds, "prompt_tokens": prompt_tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model-shape", help="A named dummy shape, e.g. qwen2.5-vl-7b.")
    source.add_argument("--model", help="A Hugging Face model directory (to try the script on a small model).")
    parser.add_argument("--image-size", type=int, default=1024, help="Square image side in pixels.")
    parser.add_argument("--text-tokens", type=int, default=64, help="Text tokens after the image.")
    parser.add_argument("--trials", type=int, default=5, help="Timed TTFT trials a side (after one warm-up).")
    parser.add_argument("--requests", type=int, default=64, help="Concurrent requests in the throughput runs.")
    parser.add_argument("--output-len", type=int, default=128, help="Output tokens per request.")
    parser.add_argument("--kv-cache-memory", default="16GiB", help="kvserve's KV cache (a size, e.g. 16GiB).")
    parser.add_argument("--skip-transformers", action="store_true", help="kvserve only.")
    parser.add_argument("--device", default="cuda", help="cuda; cpu only to try the script on a small --model.")
    args = parser.parse_args()

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.model is not None:
        llm = LLM(model=args.model, device=args.device, dtype=str(dtype).removeprefix("torch."),
                  max_num_seqs=args.requests)
    else:
        # The KV cache sized for the throughput runs, leaving room for transformers' copy.
        llm = LLM(load_format="dummy", model_shape=args.model_shape, dtype="bfloat16", max_num_seqs=args.requests,
                  skip_tokenizer_init=True, kv_cache_memory=args.kv_cache_memory)
    config_dict = llm.engine.core.model_config.hf_config
    vocab_size = llm.engine.core.model_config.vocab_size
    prompt = placeholder_prompt(config_dict, args.text_tokens, vocab_size)
    image_token_id = config_dict["image_token_id"]
    runner = llm.engine.core.runner
    results: dict[str, object] = {"model": args.model or args.model_shape, "image_size": args.image_size,
                                  "text_tokens": args.text_tokens, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}

    hf = None if args.skip_transformers else hf_model_and_processor(args, llm, device, dtype)
    seed = 0
    kv_times, hf_times, encoder_shares = [], [], []
    for trial in range(args.trials + 1):  # trial 0 warms both up
        seed += 1
        encoder_before = runner.encoder_cache.encoder_seconds
        kv = kvserve_ttft(llm, prompt, random_image(args.image_size, seed), device)
        encoder = runner.encoder_cache.encoder_seconds - encoder_before
        seed += 1
        theirs = None if hf is None else hf_ttft(*hf, prompt, random_image(args.image_size, seed), image_token_id,
                                                 device)
        if trial:
            kv_times.append(kv)
            encoder_shares.append(encoder)
            if theirs is not None:
                hf_times.append(theirs)
    results["kvserve_ttft_ms"] = 1e3 * statistics.median(kv_times)
    results["kvserve_encoder_ms"] = 1e3 * statistics.median(encoder_shares)
    if hf_times:
        results["transformers_ttft_ms"] = 1e3 * statistics.median(hf_times)
        results["ttft_ratio"] = statistics.median(kv_times) / statistics.median(hf_times)
    print(json.dumps(results), flush=True)
    if hf is not None:
        del hf
        torch.cuda.empty_cache()

    image_requests = [{"prompt_token_ids": prompt, "multi_modal_data": {"image": random_image(args.image_size, 10_000 + i)}}
                      for i in range(args.requests)]
    expanded_len = len(prompt) - 1 + llm.engine.image_processing.preprocess(image_requests[0]["multi_modal_data"]["image"])[1]
    rng = np.random.default_rng(0)
    text_requests = [{"prompt_token_ids": rng.integers(*text_id_range(vocab_size), expanded_len).tolist()}
                     for _ in range(args.requests)]
    throughput(llm, text_requests[:4], 8, device)  # warm-up
    results["text_only"] = throughput(llm, text_requests, args.output_len, device)
    results["with_images"] = throughput(llm, image_requests, args.output_len, device)
    results["image_over_text_output_tok_s"] = (results["with_images"]["output_tok_s"]  # type: ignore[index]
                                               / results["text_only"]["output_tok_s"])  # type: ignore[index]
    results["graph_replays"] = sum(runner.cuda_graphs.replays.values()) if runner.cuda_graphs else 0
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
