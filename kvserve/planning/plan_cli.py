"""`kvserve plan`: does a model fit a device, how many sequences at a workload, how fast at best."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, replace

import torch

from kvserve.config import ModelConfig
from kvserve.engine.engine_args import KV_CACHE_DTYPES
from kvserve.planning.capacity import Plan, PlanOptions, plan
from kvserve.planning.devices import known_devices, resolve_device
from kvserve.planning.suggest import suggestions
from kvserve.planning.workload import sharegpt_mean_lengths
from kvserve.utils import parse_size


def _dataset_lengths(args: argparse.Namespace) -> tuple[int, int]:
    """--dataset's mean lengths, counted by --tokenizer or the model's own tokenizer."""
    source = args.tokenizer
    if source is None and args.model_shape is None and args.hf_config is None:
        from kvserve.model_executor.default_model import default_model_path

        source = args.model or default_model_path()
    if source is None:
        raise ValueError("--dataset needs --tokenizer to count tokens with --model-shape or --hf-config")
    return sharegpt_mean_lengths(args.dataset, source, args.num_prompts)


def model_shape(model: str | None, shape: str | None, hf_config: str | None) -> tuple[ModelConfig, str]:
    """(the model's config, a name for it) from exactly one of the three sources, or the
    embedded default model when none is given."""
    if sum(source is not None for source in (model, shape, hf_config)) > 1:
        raise ValueError("give one of --model, --model-shape and --hf-config")
    if shape is not None:
        from kvserve.model_executor.dummy import dummy_model_config

        return dummy_model_config(shape), shape
    from kvserve.model_executor.loader import hf_model_config

    if hf_config is not None:
        if not os.path.isfile(hf_config):
            raise ValueError(f"{hf_config}: no such file")
        return hf_model_config(hf_config, torch.float32), hf_config
    if model is None:
        from kvserve.model_executor.default_model import default_model_path

        model = default_model_path()
    if os.path.isdir(model):
        return hf_model_config(model, torch.float32), model
    if not os.path.isfile(model):
        raise ValueError(f"{model}: no such file or directory")
    from kvserve.model_executor.gguf_loader import gguf_model_config, open_gguf

    return gguf_model_config(open_gguf(model), model, torch.float32), os.path.basename(model)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    source = parser.add_argument_group("model (one of; default: the embedded SmolLM2-135M)")
    source.add_argument("--model", default=None,
                        help="Hugging Face model directory or .gguf file (only its config is read).")
    source.add_argument("--model-shape", default=None,
                        help="A named shape: llama3-8b, qwen2.5-0.5b or smollm2-135m.")
    source.add_argument("--hf-config", default=None, help="A Hugging Face config.json file.")
    engine = parser.add_argument_group("device and engine settings")
    engine.add_argument("--device", default="auto",
                        help=f"One of {known_devices()} (cpu:64 is a CPU with 64 GiB; CPU ceilings "
                        "are measured on this machine).")
    engine.add_argument("--bandwidth-gbps", type=float, default=None,
                        help="Memory bandwidth in GB/s instead of the device's.")
    engine.add_argument("--peak-tflops", type=float, default=None,
                        help="Matmul peak in TFLOP/s instead of the device's.")
    engine.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="Ranks the model is split over.")
    engine.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                        help="Run dtype (auto: bfloat16 on GPU, float32 on CPU, as the engine).")
    engine.add_argument("--quantization", default=None, choices=["none", "int8", "int4", "nf4", "fp8"],
                        help="Weight quantization applied at load.")
    engine.add_argument("--quantization-config", default=None, type=json.loads,
                        help='JSON options of the method, e.g. \'{"group_size": 32}\'.')
    engine.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                        help="KV-cache storage dtype (auto: the run dtype).")
    engine.add_argument("--max-model-len", type=int, default=None, help="Context limit; default: the model's.")
    engine.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="Fraction of GPU memory for weights, activations and KV.")
    engine.add_argument("--kv-cache-memory", default=None,
                        help="KV budget on a CPU, e.g. 2GiB (default: the engine's, 2GiB).")
    engine.add_argument("--block-size", type=int, default=16, help="Tokens per KV block.")
    engine.add_argument("--max-num-seqs", type=int, default=256, help="Most sequences in one step.")
    engine.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="Token budget of one step, which sizes the activation peak "
                        "(default: serve's, 512 on CPU, 2048 on GPU).")
    workload = parser.add_argument_group("workload")
    workload.add_argument("--input-len", type=int, default=1024, help="Prompt tokens of a request.")
    workload.add_argument("--output-len", type=int, default=256, help="Output tokens of a request.")
    workload.add_argument("--dataset", default=None,
                          help="A ShareGPT JSON file: the workload is the mean prompt and answer length "
                          "of --num-prompts of its conversations (as `kvserve bench serve` samples them), "
                          "instead of --input-len and --output-len.")
    workload.add_argument("--num-prompts", type=int, default=256, help="Conversations of --dataset to average.")
    workload.add_argument("--tokenizer", default=None,
                          help="Tokenizer directory or .gguf file that counts --dataset's tokens "
                          "(default: the model's own, from --model or the embedded model).")
    workload.add_argument("--concurrency", type=int, default=None,
                          help="Sequences that must be resident at once for the plan to fit.")
    parser.add_argument("--json", action="store_true", help="Print the plan as JSON.")


def options_from_args(args: argparse.Namespace, input_len: int, output_len: int) -> PlanOptions:
    return PlanOptions(
        tensor_parallel_size=args.tensor_parallel_size, dtype=args.dtype, quantization=args.quantization,
        quantization_config=args.quantization_config, kv_cache_dtype=args.kv_cache_dtype,
        max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
        block_size=args.block_size,
        kv_cache_memory=None if args.kv_cache_memory is None else parse_size(args.kv_cache_memory),
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        input_len=input_len, output_len=output_len, concurrency=args.concurrency,
    )


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def format_plan(p: Plan, alternatives: list[tuple[str, Plan]]) -> str:
    ranks = f" a rank ({p.tensor_parallel_size} ranks)" if p.tensor_parallel_size > 1 else ""
    rows = [
        ("model", p.model),
        ("device", f"{p.device} ({p.device_source})"),
        ("dtype / KV cache", f"{p.dtype}{' + ' + p.quantization if p.quantization else ''} / {p.kv_cache_dtype}"),
        (f"weights{ranks}", f"{_gb(p.weight_bytes)} ({_gb(p.weight_bytes_per_step)} read per decode step)"),
        ("activation peak (estimate)", _gb(p.activation_peak_bytes) if p.activation_peak_bytes else "-"),
        (f"KV per token{ranks}", f"{p.kv_bytes_per_token:,} bytes"),
        ("KV budget / blocks", f"{_gb(p.kv_budget_bytes)} / {p.num_blocks:,} blocks of {p.block_size} "
                               f"({p.num_blocks * p.block_size:,} tokens)"),
        ("request", f"{p.request_tokens:,} tokens, {_gb(p.request_kv_bytes_total)} of KV (max_model_len "
                    f"{p.max_model_len:,})"),
        ("concurrent sequences", f"{p.concurrent_sequences:,} fit ({p.running_sequences:,} with max_num_seqs)"),
        ("decode floor", f"{p.decode_step_floor_batch1_s * 1e3:.2f} ms/step at batch 1"
                         + (f"; {p.decode_step_floor_s * 1e3:.2f} ms at {p.running_sequences} "
                            f"= {p.decode_output_tok_s:,.0f} output tok/s" if p.running_sequences > 1 else "")),
        ("prefill floor", f"{p.prefill_floor_s * 1e3:.1f} ms for one prompt"),
        ("fits", "yes" if p.fits else "no"),
    ]
    width = max(len(label) for label, _ in rows)
    lines = [f"{label:<{width}}  {value}" for label, value in rows]
    lines += [f"  - {problem}" for problem in p.problems]
    if alternatives:
        lines.append("what would fit:")
        lines += [f"  {flags}: {alt.concurrent_sequences:,} sequences, {alt.decode_output_tok_s:,.0f} "
                  f"output tok/s floor" for flags, alt in alternatives]
    elif not p.fits:
        lines.append("no single change (quantization, fp8 KV cache, more ranks, shorter context) fits")
    return "\n".join(lines)


def run_from_args(args: argparse.Namespace) -> int:
    config, name = model_shape(args.model, args.model_shape, args.hf_config)
    device = resolve_device(args.device)
    if args.bandwidth_gbps is not None or args.peak_tflops is not None:
        device = replace(device, bandwidth=(args.bandwidth_gbps or device.bandwidth / 1e9) * 1e9,
                         peak_flops=(args.peak_tflops or device.peak_flops / 1e12) * 1e12,
                         source="ceilings given on the command line")
    lengths = (args.input_len, args.output_len) if args.dataset is None else _dataset_lengths(args)
    options = options_from_args(args, *lengths)
    result = plan(config, name, device, options)
    alternatives = [] if result.fits else suggestions(config, name, device, options, result)
    if args.json:
        print(json.dumps(asdict(result) | {"fits": result.fits, "alternatives": [
            {"flags": flags, "plan": asdict(alt)} for flags, alt in alternatives]}, indent=2))
    else:
        if args.dataset is not None:
            print(f"workload: mean of {args.num_prompts} conversations of {args.dataset}: "
                  f"{lengths[0]} prompt and {lengths[1]} output tokens")
        print(format_plan(result, alternatives))
    return 0 if result.fits else 1
