"""An expert-parallel mixture-of-experts layer over N ranks, its two ways of combining the
ranks' work side by side: the all-reduce of every rank's part of every token, and the
all_to_all exchange (layers/moe.py SparseMoE._exchange). Random weights in a model's expert
shape (no shared expert), one layer, the ranks holding the same tokens as after
tensor-parallel attention. Each time is the median over calls of the slowest rank's
forward; "bytes" is what each rank sends a call by use_all_to_all's count (ring all-reduce;
the exchange with even routing), and "auto" which form KVSERVE_EP_DISPATCH=auto picks.

    PYTHONPATH=. python benchmarks/ep_dispatch.py --ranks 8 [--shape mixtral-8x7b] [--tokens 1 64 2048]
    PYTHONPATH=. python benchmarks/ep_dispatch.py --device cpu --ranks 2 --shape tiny   (gloo)
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import statistics
import time

import torch

# experts, top_k, hidden, expert intermediate
SHAPES = {"mixtral-8x7b": (8, 2, 4096, 14336), "qwen3-30b-a3b": (128, 8, 2048, 768), "tiny": (8, 2, 256, 512)}
FORMS = ("all_reduce", "all_to_all")


def sent_rows(form: str, ranks: int, top_k: int, tokens: int) -> float:
    """Hidden-state rows a rank sends (use_all_to_all's count)."""
    if form == "all_reduce":
        return 2 * (ranks - 1) / ranks * tokens
    return (ranks - 1) * -(-tokens // ranks) * (1 + 2 * top_k / ranks)


def _rank(rank: int, args: argparse.Namespace, port: int, results) -> None:
    from kvserve.distributed import parallel_state as ps
    from kvserve.model_executor.layers.moe import SparseMoE, use_all_to_all

    device = torch.device(f"cuda:{rank}" if args.device == "cuda" else "cpu")
    if args.device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.ranks))
    ps.init_distributed_environment(args.ranks, rank, f"tcp://127.0.0.1:{port}", device)
    ps.initialize_model_parallel(args.ranks)
    group = ps.get_tp_group()
    num_experts, top_k, hidden, intermediate = SHAPES[args.shape]
    dtype = getattr(torch, args.dtype)
    with torch.device("meta"):
        moe = SparseMoE(hidden, intermediate, num_experts, top_k, renormalize=True)
    per_rank = num_experts // args.ranks
    for index in range(num_experts):
        if index // per_rank != rank:
            moe.experts[index] = None
    moe = moe.to_empty(device=device).to(dtype)
    generator = torch.Generator(device).manual_seed(0)
    for parameter in moe.parameters():
        parameter.data.normal_(0, hidden**-0.5, generator=generator)
    moe.gate.weight.data.normal_(0, 1, generator=torch.Generator(device).manual_seed(1))  # the same router everywhere
    moe.set_parallel(group, expert_parallel=True)
    rows = []
    for tokens in args.tokens:
        x = torch.randn(tokens, hidden, device=device, dtype=dtype, generator=torch.Generator(device).manual_seed(2))
        times = {}
        for form in FORMS:
            os.environ["KVSERVE_EP_DISPATCH"] = form
            samples = []
            with torch.no_grad():
                for call in range(args.warmup + args.calls):
                    group.all_reduce(torch.zeros(1, device=device))  # start together
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    start = time.perf_counter()
                    moe(x)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    elapsed = torch.tensor([time.perf_counter() - start], device=device)
                    torch.distributed.all_reduce(elapsed, torch.distributed.ReduceOp.MAX, group=group.device_group)
                    if call >= args.warmup:
                        samples.append(elapsed.item())
            times[form] = statistics.median(samples)
        os.environ["KVSERVE_EP_DISPATCH"] = "auto"
        auto = "all_to_all" if use_all_to_all(args.ranks, top_k, False, tokens) else "all_reduce"
        rows.append((tokens, times, auto))
    if rank == 0:
        results.extend(rows)
    ps.destroy_model_parallel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--shape", choices=SHAPES, default="mixtral-8x7b")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 2048])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager:
        results = manager.list()
        processes = [context.Process(target=_rank, args=(rank, args, port, results)) for rank in range(args.ranks)]
        for process in processes:
            process.start()
        for process in processes:
            process.join()
        if any(process.exitcode for process in processes):
            raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in processes]}")
        results = list(results)
    top_k, hidden = SHAPES[args.shape][1], SHAPES[args.shape][2]
    row_bytes = hidden * torch.empty(0, dtype=getattr(torch, args.dtype)).element_size()
    print(f"{args.shape}, {args.ranks} ranks, {args.device}, {args.dtype}")
    print(f"{'tokens':>6} {'all-reduce ms':>14} {'all_to_all ms':>14} {'all-reduce bytes':>17} "
          f"{'all_to_all bytes':>17} {'auto':>11}")
    for tokens, times, auto in results:
        sent = [sent_rows(form, args.ranks, top_k, tokens) * row_bytes for form in FORMS]
        print(f"{tokens:>6} {times['all_reduce'] * 1e3:>14.3f} {times['all_to_all'] * 1e3:>14.3f} "
              f"{sent[0]:>17,.0f} {sent[1]:>17,.0f} {auto:>11}")


if __name__ == "__main__":
    main()
