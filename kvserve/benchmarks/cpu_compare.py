"""CPU serving side by side: llama.cpp's `llama-server` and `kvserve serve` on the same GGUF
with the same thread count, one server at a time, both driven by `kvserve bench serve`
(the same random token-id prompts, streaming, ignore_eos, greedy).

Load points (128 prompt / 128 output tokens each):
  1-stream   requests one after another (max concurrency 1)
  16-streams 32 requests, 16 in flight at once
  poisson    Poisson arrivals at a rate just below llama.cpp's saturation: a fraction
             (default 0.8) of the request throughput llama.cpp reached at 16 streams
             in the same run, so the point follows the machine it runs on

Prints one table (output tok/s, TTFT p50/p99, ITL p50/p99 per engine and kvserve's ratio
to llama.cpp, plus each server's peak resident memory under the 16-stream load) and writes
the full results as JSON. `--rounds N` runs the engines N times, alternating, on fresh
servers each round: the table then shows each metric's median and the spread over rounds
(a shared or virtual machine's speed drifts between runs: single-stream ITL p50 of the same
kvserve ranged 9.8-14.6 ms over seven runs on a 2-core VM; BENCHMARKS.md, "CPU serving
beside llama.cpp"). `--quick` is the
CI smoke mode: kvserve only, 4 short requests, no llama.cpp build.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace

import psutil

from kvserve.model_executor.default_model import default_model_path

logger = logging.getLogger(__name__)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_RESULTS_DIR = os.path.join(REPO_ROOT, "benchmarks", "results")
SERVER_START_TIMEOUT_S = 300
ENGINES = ("llama.cpp", "kvserve")


@dataclass
class LoadPoint:
    name: str
    num_prompts: int
    max_concurrency: int | None
    request_rate: float = math.inf
    input_len: int = 128
    output_len: int = 128
    measure_rss: bool = False
    # Added to --seed for this point's prompts. Each point draws its own: with one seed the
    # Poisson point would resend the 16-stream point's prompts, and llama.cpp's slots, which
    # keep a finished request's KV, answered them from it (TTFT ~23 ms for 128 tokens).
    seed_offset: int = 0


@dataclass
class ServerRun:
    """One server process and the resident-memory samples taken while it runs."""

    process: subprocess.Popen
    base_url: str
    log_path: str
    rss_samples: list[int] = field(default_factory=list)

    def rss_bytes(self) -> int:
        """Resident memory of the server and its children (0 once it has exited)."""
        try:
            root = psutil.Process(self.process.pid)
            return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
        except psutil.Error:
            return 0

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)


def physical_cores() -> int:
    """Cores this process may run on, counting SMT siblings once."""
    logical = len(os.sched_getaffinity(0))
    physical = psutil.cpu_count(logical=False) or logical
    return max(1, min(logical, physical))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _kvserve_env(threads: int) -> dict[str, str]:
    # Child processes import this tree's kvserve, not whatever is installed.
    pythonpath = os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": pythonpath, "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": str(threads)}


def _wait_healthy(run: ServerRun, what: str) -> None:
    import httpx

    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if run.process.poll() is not None:
            raise RuntimeError(f"{what} exited with {run.process.returncode}; log: {run.log_path}\n"
                               f"{_tail(run.log_path)}")
        try:
            if httpx.get(f"{run.base_url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    run.stop()
    raise RuntimeError(f"{what} did not become healthy in {SERVER_START_TIMEOUT_S} s; log: {run.log_path}")


def _tail(path: str, lines: int = 30) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


def start_llama_server(binary: str, gguf: str, threads: int, slots: int, ctx_per_slot: int,
                       log_dir: str) -> ServerRun:
    port = _free_port()
    log_path = os.path.join(log_dir, "llama-server.log")
    command = [
        binary, "--model", gguf, "--host", "127.0.0.1", "--port", str(port),
        "--threads", str(threads), "--threads-batch", str(threads),
        "--parallel", str(slots), "--ctx-size", str(slots * ctx_per_slot),
        "--cont-batching", "--no-webui",
    ]
    logger.info("starting llama-server: %s", shlex.join(command))
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    run = ServerRun(process, f"http://127.0.0.1:{port}", log_path)
    _wait_healthy(run, "llama-server")
    return run


def start_kvserve(threads: int, extra_args: list[str], log_dir: str) -> ServerRun:
    port = _free_port()
    log_path = os.path.join(log_dir, "kvserve-serve.log")
    command = [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", "--host", "127.0.0.1",
               "--port", str(port), *extra_args]
    logger.info("starting kvserve: %s (OMP_NUM_THREADS=%d)", shlex.join(command), threads)
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   env=_kvserve_env(threads))
    run = ServerRun(process, f"http://127.0.0.1:{port}", log_path)
    _wait_healthy(run, "kvserve serve")
    return run


def run_bench(run: ServerRun, point: LoadPoint, seed: int, json_path: str, threads: int) -> dict:
    """`kvserve bench serve` against one server; samples its RSS while the load runs."""
    command = [
        sys.executable, "-m", "kvserve.entrypoints.cli", "--log-level", "WARNING", "bench", "serve",
        "--base-url", run.base_url, "--endpoint", "completions", "--dataset", "random",
        "--num-prompts", str(point.num_prompts),
        "--input-len", str(point.input_len), str(point.input_len),
        "--output-len", str(point.output_len), str(point.output_len),
        "--seed", str(seed), "--ignore-eos", "--temperature", "0",
        "--request-rate", "inf" if math.isinf(point.request_rate) else f"{point.request_rate:.4f}",
        "--output-json", json_path,
    ]
    if point.max_concurrency is not None:
        command += ["--max-concurrency", str(point.max_concurrency)]
    samples: list[int] = []
    stop = threading.Event()

    def sample_rss() -> None:
        while not stop.wait(0.5):
            samples.append(run.rss_bytes())

    sampler = threading.Thread(target=sample_rss, daemon=True) if point.measure_rss else None
    if sampler:
        sampler.start()
    started = time.perf_counter()
    # The client gets one thread: it shares the cores with the server it measures.
    result = subprocess.run(command, env=_kvserve_env(1), capture_output=True, text=True)
    elapsed = time.perf_counter() - started
    stop.set()
    if sampler:
        sampler.join()
    if result.returncode != 0:
        raise RuntimeError(f"bench serve ({point.name}) failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    with open(json_path) as f:
        data = json.load(f)
    data["wall_s"] = elapsed
    data["peak_rss_bytes"] = max(samples) if samples else None
    data["output_tokens_expected"] = point.num_prompts * point.output_len
    return data


def summarize(data: dict) -> dict:
    return {
        "output_tok_s": data["output_throughput"],
        "request_throughput": data["request_throughput"],
        "ttft_p50_ms": data["ttft_ms"]["p50"], "ttft_p99_ms": data["ttft_ms"]["p99"],
        "itl_p50_ms": data["itl_ms"]["p50"], "itl_p99_ms": data["itl_ms"]["p99"],
        "completed": data["completed"], "failed": data["failed"],
        "output_tokens": data["total_output_tokens"],
        "output_tokens_expected": data["output_tokens_expected"],
        "request_rate": data["request_rate"], "duration_s": data["duration_s"],
        "peak_rss_mib": None if data["peak_rss_bytes"] is None else data["peak_rss_bytes"] / 2**20,
    }


# Per-round counts that add up over rounds; every other number is a rate or a latency,
# combined as the median.
_COUNTS = ("completed", "failed", "output_tokens", "output_tokens_expected")


def combine_rounds(rounds: list[dict]) -> dict:
    """One engine's summaries of one load point over rounds: counts summed, the other numbers'
    medians, and the rounds themselves under "rounds" (one round: that summary as it is)."""
    if len(rounds) == 1:
        return rounds[0]
    combined: dict = {}
    for key, first in rounds[0].items():
        values = [summary[key] for summary in rounds]
        if key in _COUNTS:
            combined[key] = sum(values)
        elif all(isinstance(v, (int, float)) for v in values):
            combined[key] = statistics.median(values)
        else:
            combined[key] = first
    return combined | {"rounds": rounds}


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _ratio(ours: float | None, theirs: float | None) -> str:
    return "-" if not ours or not theirs else f"{ours / theirs:.2f}x"


def _spread(ours: dict, llama: dict, key: str) -> str:
    """Over rounds: the range of kvserve's value and of its per-round ratio to llama.cpp (round
    i against round i, run one after the other)."""
    rounds = ours.get("rounds") or []
    values = [r[key] for r in rounds if r.get(key) is not None]
    if not values:
        return ""
    text = f"{_fmt(min(values))}-{_fmt(max(values))}"
    theirs = llama.get("rounds") or []
    ratios = [a[key] / b[key] for a, b in zip(rounds, theirs) if a.get(key) and b.get(key)]
    if ratios:
        text += f" ({min(ratios):.2f}-{max(ratios):.2f}x)"
    return text


def format_table(results: dict[str, dict[str, dict]], points: list[str]) -> str:
    """One row per load point and metric: llama.cpp, kvserve, kvserve / llama.cpp (medians
    over rounds), and past one round the spread (_spread)."""
    metrics = [("output tok/s", "output_tok_s"), ("TTFT p50 ms", "ttft_p50_ms"),
               ("TTFT p99 ms", "ttft_p99_ms"), ("ITL p50 ms", "itl_p50_ms"),
               ("ITL p99 ms", "itl_p99_ms")]
    rounds = max((len(point.get("rounds") or [1]) for engine in results.values() for point in engine.values()
                  if isinstance(point, dict)), default=1)
    header = f"{'load point':<12} {'metric':<16} {'llama.cpp':>11} {'kvserve':>11} {'kvserve/llama':>14}"
    if rounds > 1:
        header += f"  {rounds} rounds: kvserve min-max (ratio)"
    lines = [header, "-" * len(header)]
    for point in points:
        llama = results.get("llama.cpp", {}).get(point, {})
        ours = results.get("kvserve", {}).get(point, {})
        if not llama and not ours:
            continue
        label = point
        rate = (ours or llama).get("request_rate")
        if rate is not None and not math.isinf(rate):
            label = f"{point} {rate:.2f}/s"
        for name, key in metrics:
            line = (f"{label:<12} {name:<16} {_fmt(llama.get(key)):>11} {_fmt(ours.get(key)):>11} "
                    f"{_ratio(ours.get(key), llama.get(key)):>14}")
            lines.append(f"{line}  {_spread(ours, llama, key)}".rstrip())
            label = ""
        if point in ("16-streams", "quick"):  # the points whose server RSS is sampled
            lines.append(f"{'':<12} {'peak RSS MiB':<16} {_fmt(llama.get('peak_rss_mib'), 0):>11} "
                         f"{_fmt(ours.get('peak_rss_mib'), 0):>11} "
                         f"{_ratio(ours.get('peak_rss_mib'), llama.get('peak_rss_mib')):>14}")
    return "\n".join(lines)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="CI smoke mode: kvserve only, 4 short requests (4 streams), no llama.cpp build.")
    parser.add_argument("--threads", type=int, default=None,
                        help="Compute threads for both servers (default: the physical cores available).")
    parser.add_argument("--model", default=None,
                        help="GGUF both servers load (default: the embedded SmolLM2-135M-Instruct Q4_1).")
    parser.add_argument("--engines", default="llama.cpp,kvserve",
                        help="Comma-separated engines to run, in order (llama.cpp, kvserve).")
    parser.add_argument("--points", default="1-stream,16-streams,poisson",
                        help="Comma-separated load points: 1-stream, 16-streams, poisson "
                             "(poisson needs 16-streams, whose throughput sets its rate).")
    parser.add_argument("--single-stream-prompts", type=int, default=8,
                        help="Requests of the 1-stream point (sent one after another).")
    parser.add_argument("--poisson-prompts", type=int, default=32, help="Requests of the Poisson point.")
    parser.add_argument("--poisson-fraction", type=float, default=0.8,
                        help="Poisson rate as a fraction of llama.cpp's 16-stream request throughput "
                             "(kvserve's own when llama.cpp is not run).")
    parser.add_argument("--seed", type=int, default=0,
                        help="Seed of the prompts and arrival times (each load point adds its own offset, so "
                             "no point resends another's prompts).")
    parser.add_argument("--rounds", type=int, default=1,
                        help="Run the engines this many times, alternating, on fresh servers each round; the "
                             "table shows medians and, past one round, each metric's spread over rounds.")
    parser.add_argument("--llama-server", default=None,
                        help="Use this llama-server binary instead of building and caching one "
                             "(cache: $KVSERVE_LLAMA_CPP_DIR or ~/.cache/kvserve/llama.cpp).")
    parser.add_argument("--kvserve-args", default="",
                        help="Extra `kvserve serve` flags, one shell-quoted string joined by = (it starts "
                             "with a dash): --kvserve-args=\"--max-num-batched-tokens 256\" (default: none, so "
                             "its own CPU defaults are what is measured).")
    parser.add_argument("--output-dir", default=DEFAULT_RESULTS_DIR,
                        help="Where the JSON results (summary and per-point records) go.")
    parser.add_argument("--tag", default=None,
                        help="File name prefix of the results (default: cpu_vs_llamacpp or cpu_quick).")


def machine_info(threads: int) -> dict:
    load1, load5, _ = os.getloadavg()
    return {"platform": platform.platform(), "processor": _cpu_model(), "logical_cpus": os.cpu_count(),
            "threads": threads, "loadavg_1m_at_start": load1, "loadavg_5m_at_start": load5}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def load_points(args: argparse.Namespace) -> list[LoadPoint]:
    """The load points --quick or --points asks for, in order."""
    if args.quick:
        return [LoadPoint("quick", num_prompts=4, max_concurrency=4, input_len=32, output_len=16, measure_rss=True)]
    wanted = [p.strip() for p in args.points.split(",") if p.strip()]
    catalog = {
        "1-stream": LoadPoint("1-stream", args.single_stream_prompts, 1),
        "16-streams": LoadPoint("16-streams", 32, 16, measure_rss=True, seed_offset=2),
        "poisson": LoadPoint("poisson", args.poisson_prompts, None, seed_offset=3),
    }
    if set(wanted) - set(catalog):
        raise ValueError(f"--points: unknown {sorted(set(wanted) - set(catalog))}")
    return [catalog[name] for name in wanted]


def run_from_args(args: argparse.Namespace) -> int:
    threads = args.threads or physical_cores()
    gguf = args.model or default_model_path()
    engines = ["kvserve"] if args.quick else [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = set(engines) - set(ENGINES)
    if unknown:
        raise ValueError(f"--engines: unknown {sorted(unknown)}; choose from {', '.join(ENGINES)}")
    if args.rounds < 1:
        raise ValueError(f"--rounds must be at least 1, got {args.rounds}")
    tag = args.tag or ("cpu_quick" if args.quick else "cpu_vs_llamacpp")
    points = load_points(args)
    os.makedirs(args.output_dir, exist_ok=True)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per health poll
    started = time.perf_counter()
    info = machine_info(threads)
    print(f"{tag}: {os.path.basename(gguf)}, {threads} threads, load average {info['loadavg_1m_at_start']:.2f} "
          f"at start, engines {', '.join(engines)}", flush=True)

    per_round: dict[str, dict[str, list[dict]]] = {engine: {} for engine in engines}  # engine -> point -> rounds
    log_tails: dict[str, str] = {}
    build_info = None
    with tempfile.TemporaryDirectory(prefix="kvserve-cpu-compare-") as log_dir:
        for round_index in range(args.rounds):
            if args.rounds > 1:
                print(f"round {round_index + 1} of {args.rounds}", flush=True)
            file_tag = tag if args.rounds == 1 else f"{tag}_r{round_index + 1}"
            for engine in engines:
                run, engine_build = _start_engine(engine, args, gguf, threads, points, log_dir)
                build_info = engine_build or build_info
                try:
                    # Every engine and round gets one Poisson rate: the one llama.cpp's saturation
                    # set in the first round (else the engine's own, from its first round).
                    rate = _first_poisson_rate(per_round.get("llama.cpp")) or _first_poisson_rate(per_round[engine])
                    for name, summary in _run_points(engine, run, points, args, threads, file_tag, rate).items():
                        per_round[engine].setdefault(name, []).append(summary)
                except Exception:
                    print(f"--- {engine} server log (tail) ---\n{_tail(run.log_path)}", file=sys.stderr)
                    raise
                finally:
                    run.stop()
                    log_tails[engine] = _tail(run.log_path, 12)

    results = {engine: {name: combine_rounds(runs) for name, runs in by_point.items()}
               | {"server_log_tail": log_tails.get(engine, "")} for engine, by_point in per_round.items()}
    table = format_table(results, [p.name for p in points])
    summary = {"tag": tag, "model": gguf, "machine": info, "llama_cpp_build": build_info,
               "kvserve_args": args.kvserve_args, "seed": args.seed, "rounds": args.rounds,
               "elapsed_s": time.perf_counter() - started, "results": results, "table": table}
    summary_path = os.path.join(args.output_dir, f"{tag}.json")
    with open(summary_path, "w") as f:
        json.dump(summary, f, indent=2)
    print()
    print(table)
    print(f"\nresults: {summary_path} ({summary['elapsed_s']:.0f} s; load average now "
          f"{os.getloadavg()[0]:.2f})")
    return 0


def _start_engine(engine: str, args: argparse.Namespace, gguf: str, threads: int, points: list[LoadPoint],
                  log_dir: str) -> tuple[ServerRun, dict | None]:
    """One engine's server on the GGUF, and for llama.cpp its build's description (None if
    it has none, and for kvserve)."""
    if engine == "kvserve":
        model_args = ["--model", gguf] if args.model else []  # no flags: the defaults are measured
        return start_kvserve(threads, [*model_args, *shlex.split(args.kvserve_args)], log_dir), None
    from kvserve.benchmarks import llama_cpp_build

    binary = args.llama_server or llama_cpp_build.build_llama_server()
    build_info = None
    info_path = os.path.join(os.path.dirname(os.path.dirname(binary)), "build-info.json")
    if os.path.isfile(info_path):
        with open(info_path) as f:
            build_info = json.load(f) | {"binary": binary}
    slots = max(p.max_concurrency or 1 for p in points)
    ctx_per_slot = max(p.input_len + p.output_len for p in points) + 16  # BOS and slack
    return start_llama_server(binary, gguf, threads, max(slots, 16), ctx_per_slot, log_dir), build_info


def _first_poisson_rate(by_point: dict[str, list[dict]] | None) -> float | None:
    runs = (by_point or {}).get("poisson")
    return runs[0]["request_rate"] if runs else None


def _run_points(engine: str, run: ServerRun, points: list[LoadPoint], args: argparse.Namespace,
                threads: int, tag: str, poisson_rate: float | None) -> dict[str, dict]:
    results: dict[str, dict] = {}
    warmup = LoadPoint("warmup", num_prompts=4, max_concurrency=4, input_len=32, output_len=8, seed_offset=1)
    warmup_path = os.path.join(args.output_dir, f"{tag}_{engine}_warmup.json")
    run_bench(run, warmup, args.seed + warmup.seed_offset, warmup_path, threads)
    os.remove(warmup_path)
    for point in points:
        if point.name == "poisson":
            if poisson_rate is None and "16-streams" not in results:
                logger.warning("%s: skipping the Poisson point: its rate comes from the 16-stream point", engine)
                continue
            rate = poisson_rate or args.poisson_fraction * results["16-streams"]["request_throughput"]
            point = replace(point, request_rate=rate)
        path = os.path.join(args.output_dir, f"{tag}_{engine}_{point.name}.json")
        print(f"{engine}: {point.name} ({point.num_prompts} requests, concurrency "
              f"{point.max_concurrency or 'unlimited'}, rate {point.request_rate:g} req/s)", flush=True)
        data = run_bench(run, point, args.seed + point.seed_offset, path, threads)
        results[point.name] = summarize(data)
        if data["failed"] or data["total_output_tokens"] != data["output_tokens_expected"]:
            logger.warning("%s %s: %d failed, %d output tokens for %d expected; errors: %s", engine,
                           point.name, data["failed"], data["total_output_tokens"],
                           data["output_tokens_expected"], data["errors"])
    return results
