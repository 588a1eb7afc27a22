"""CPU time a streamed token costs `kvserve serve`'s event loop (the process's main thread,
which runs uvicorn and the SSE writes) and the whole server process, read from /proc (Linux)
around one `kvserve bench serve` run: a measure of the HTTP side's work per token that the
machine's drift between runs does not blur the way it blurs latencies. Extra arguments go to
`kvserve serve`.

    python benchmarks/cpu_server_threads.py [--requests 8] [--output-len 256] [-- SERVE FLAGS...]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

from kvserve.benchmarks.cpu_compare import LoadPoint, physical_cores, run_bench, start_kvserve

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def thread_cpu_s(pid: int, tid: int) -> float:
    """User + system CPU seconds of one thread (/proc/PID/task/TID/stat fields 14 and 15)."""
    with open(f"/proc/{pid}/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def process_cpu_s(pid: int) -> float:
    total = 0.0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            total += thread_cpu_s(pid, int(tid))
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8, help="Requests, sent one after another.")
    parser.add_argument("--output-len", type=int, default=256, help="Output tokens a request.")
    parser.add_argument("serve_args", nargs=argparse.REMAINDER, help="Flags for `kvserve serve` (after --).")
    args = parser.parse_args()
    serve_args = [a for a in args.serve_args if a != "--"]
    threads = physical_cores()
    with tempfile.TemporaryDirectory(prefix="kvserve-threads-") as tmp:
        run = start_kvserve(threads, serve_args, tmp)
        try:
            pid = run.process.pid
            warmup = LoadPoint("warmup", num_prompts=2, max_concurrency=1, input_len=32, output_len=8)
            run_bench(run, warmup, 1, os.path.join(tmp, "warmup.json"), threads)
            point = LoadPoint("1-stream", args.requests, 1, output_len=args.output_len)
            main_before, all_before = thread_cpu_s(pid, pid), process_cpu_s(pid)
            data = run_bench(run, point, 0, os.path.join(tmp, "run.json"), threads)
            main_s, all_s = thread_cpu_s(pid, pid) - main_before, process_cpu_s(pid) - all_before
        finally:
            run.stop()
    tokens = data["total_output_tokens"]
    result = {"serve_args": serve_args, "output_tokens": tokens, "itl_p50_ms": data["itl_ms"]["p50"],
              "event_loop_cpu_ms_a_token": 1e3 * main_s / tokens, "process_cpu_ms_a_token": 1e3 * all_s / tokens}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
