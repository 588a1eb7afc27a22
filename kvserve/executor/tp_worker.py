"""One rank of tensor and pipeline parallelism: loads the model, keeps its stage's layers
(model_executor/pipeline_parallel.py) and its share of them (tensor_parallel.py), and runs
every step on it. Every rank takes the steps from the driver, in order; the first rank of
the last stage returns the output."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from kvserve.config import CacheConfig, ModelConfig, SchedulerConfig
from kvserve.engine.engine_args import EngineArgs
from kvserve.logger import configure_logging

logger = logging.getLogger(__name__)


@dataclass
class WorkerInfo:
    """What rank 0 tells the driver once every rank is ready."""

    model_config: ModelConfig  # the whole model's
    tokenizer: Any
    num_blocks: int  # the same on every rank
    kv_cache_dtype: torch.dtype
    attention_backend_name: str
    decode_weight_bytes: int  # all ranks together
    expert_weight_bytes: int  # likewise


def worker_device(args: EngineArgs, gpu_index: int) -> torch.device:
    """The rank's device: GPU `gpu_index` of those this process sees, or the CPU."""
    device = args.resolved_device()
    return torch.device("cuda", gpu_index) if device.type == "cuda" else device


def output_rank(args: EngineArgs) -> int:
    """The rank that returns each step's output: the first of the last stage."""
    return (args.pipeline_parallel_size - 1) * args.tensor_parallel_size


def run_worker(
    args: EngineArgs, rank: int, world_size: int, init_method: str, connection: Connection,
    num_threads: int, log_level: int,
) -> None:
    configure_logging(log_level)
    torch.set_num_threads(num_threads)
    try:
        runner, info = start_rank(args, rank, world_size, init_method, worker_device(args, rank))
    except BaseException as error:  # reported to the driver, which raises it
        connection.send(("error", RuntimeError(f"tensor-parallel rank {rank} failed to start: {error!r}")))
        return
    connection.send(("ready", info))
    try:
        _serve(runner, connection, rank == output_rank(args))
    except (EOFError, BrokenPipeError):
        pass  # the driver is gone


def start_rank(
    args: EngineArgs, rank: int, world_size: int, init_method: str, device: torch.device,
) -> tuple[Any, WorkerInfo | None]:
    """Join the group, load, shard and quantize; returns (runner, rank 0's info)."""
    from kvserve.distributed import parallel_state
    from kvserve.model_executor.model_runner import ModelRunner
    from kvserve.model_executor.tensor_parallel import quantize_shard

    parallel_state.init_distributed_environment(world_size, rank, init_method, device)
    parallel_state.initialize_model_parallel(args.tensor_parallel_size, args.pipeline_parallel_size)
    world = parallel_state.get_world_group()
    loaded, config = _load_share(args, rank, device)
    quantize_shard(loaded, args.quantization, args.quantization_config, device)
    max_model_len = args.max_model_len or loaded.config.max_position_embeddings
    runner = ModelRunner(
        loaded.model, config,
        CacheConfig(block_size=args.block_size, kv_cache_memory=args.kv_cache_bytes(),
                    gpu_memory_utilization=args.gpu_memory_utilization,
                    kv_cache_dtype=args.resolved_kv_cache_dtype()),
        SchedulerConfig(max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.resolved_max_num_batched_tokens(device)),
        device, args.attention_backend, max_model_len, enforce_eager=True, tokenizer=loaded.tokenizer,
    )
    # Every rank must hold every block the scheduler hands out: the smallest cache wins.
    sizes = torch.tensor([runner.num_blocks, runner.decode_weight_bytes, runner.expert_weight_bytes])
    dist.all_reduce(sizes[:1], op=dist.ReduceOp.MIN, group=world.cpu_group)
    dist.all_reduce(sizes[1:], op=dist.ReduceOp.SUM, group=world.cpu_group)
    num_blocks, weight_bytes, expert_bytes = sizes.tolist()
    runner.resize_kv_cache(num_blocks)
    info = WorkerInfo(loaded.config, loaded.tokenizer, num_blocks, runner.kv_cache_dtype,
                      type(runner.attn_backend).__name__, weight_bytes, expert_bytes) if rank == 0 else None
    return runner, info


def _load_share(args: EngineArgs, rank: int, device: torch.device) -> tuple[Any, ModelConfig]:
    """(the rank's share of the model, loaded in float; the config of what it holds). A
    float safetensors directory is read a slice per rank (sharded_loader.py); anything
    else (GGUF, dummy weights) is loaded whole and cut down."""
    from kvserve.distributed import parallel_state
    from kvserve.engine.core import load_engine_model
    from kvserve.model_executor.loader import load_tokenizer
    from kvserve.model_executor.pipeline_parallel import keep_stage
    from kvserve.model_executor.sharded_loader import can_load_sharded, load_rank_share
    from kvserve.model_executor.tensor_parallel import shard_model
    from kvserve.quantization.cpu_plan import NONE

    tp_group, pp_group = parallel_state.get_tp_group(), parallel_state.get_pp_group()
    if can_load_sharded(args.model, args.load_format):
        loaded, config, read = load_rank_share(args.model, args.resolved_dtype(device), device, tp_group, pp_group,
                                               args.enable_expert_parallel)
        if not args.skip_tokenizer_init:
            loaded.tokenizer = load_tokenizer(args.tokenizer or args.model)
        logger.info("rank %d read %.1f MB of the checkpoint's %.1f MB", rank, read.bytes_read / 1e6,
                    read.checkpoint_bytes / 1e6)
        return loaded, config
    loaded = load_engine_model(replace(args, device=str(device), quantization=NONE, quantization_config=None))
    config = loaded.config
    if args.pipeline_parallel_size > 1:
        config = keep_stage(loaded.model, pp_group)
    if args.tensor_parallel_size > 1:
        heads = shard_model(loaded.model, tp_group, args.enable_expert_parallel)
        config = replace(config, num_attention_heads=heads.num_attention_heads,
                         num_key_value_heads=heads.num_key_value_heads)
    return loaded, config


def _serve(runner: Any, driver: Connection, answers: bool) -> None:
    """Run the driver's steps in order until told to stop; the rank that `answers` returns
    their outputs. Every rank reads the steps from its own pipe rather than from a
    broadcast, which would hold each stage until the last one has finished the step before."""
    while True:
        kind, sched = driver.recv()
        if kind == "shutdown":
            return
        output = runner.execute(sched)
        if answers:
            driver.send(("output", output))
