"""`kvserve bench serve`: load generator for any OpenAI-compatible server.

Sends streamed completions or chat requests with Poisson arrivals (optionally capped in
concurrency) and reports throughput, TTFT / TPOT / ITL / E2E and goodput as
`vllm bench serve` defines them (see serve_metrics). `--sweep` runs several request rates
and draws latency against output throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import random
import re
import sys
import time
from dataclasses import replace

import aiohttp
from tqdm import tqdm

from kvserve import envs
from kvserve.benchmarks.serve_datasets import (
    BenchPrompt,
    random_image_urls,
    random_prompts,
    shared_prefix_prompts,
    sharegpt_prompts,
)
from kvserve.benchmarks.serve_metrics import RequestRecord, compute_metrics
from kvserve.engine.kv_report import summarize_reports

logger = logging.getLogger(__name__)

CHARS_PER_TOKEN = 4  # token-count estimate when the server has no /tokenize
CHECK_MAX_TOKENS = 2
START_UP_WAIT_S = 600.0  # most time to wait for a kvserve server's CPU decode graphs
KV_SAMPLE_INTERVAL_S = 0.5  # how often a run samples a kvserve server's /debug/kv


class BenchmarkError(Exception):
    """The server cannot be benchmarked (unreachable, no model, first request fails)."""


class OpenAIClient:
    def __init__(
        self, session: aiohttp.ClientSession, base_url: str, api_key: str | None, endpoint: str
    ) -> None:
        self.session = session
        # Accept OpenAI-style base URLs ending in /v1 too; /tokenize lives at the root.
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.chat = endpoint == "chat"
        self.url = f"{self.base_url}/v1/{'chat/completions' if self.chat else 'completions'}"
        self.model = ""
        self.sampling: dict = {}
        self.can_tokenize = True

    async def _get_json(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        async with self.session.request(
            method, self.base_url + path, json=body, headers=self.headers
        ) as response:
            try:
                return response.status, await response.json(content_type=None)
            except json.JSONDecodeError:
                return response.status, {}

    async def wait_for_decode_graphs(self, timeout_s: float = START_UP_WAIT_S, poll_s: float = 1.0) -> None:
        """Until a kvserve server's CPU decode graphs are compiled (its /metrics gauge reads
        0): it serves before they are and compiles them whenever it is idle, which would land
        inside the measurement. Servers without the gauge are not waited for."""
        deadline = time.monotonic() + timeout_s
        while True:
            async with self.session.get(self.base_url + "/metrics", headers=self.headers) as response:
                text = await response.text() if response.status == 200 else ""
            pending = re.search(r"^kvserve:decode_graphs_pending\{[^}]*\} (\S+)$", text, re.MULTILINE)
            if pending is None or float(pending.group(1)) == 0:
                return
            if time.monotonic() > deadline:
                logger.warning("the server still compiles %s decode graphs after %.0f s; measuring anyway",
                               pending.group(1), timeout_s)
                return
            logger.info("waiting for the server to compile %s more decode graphs", pending.group(1))
            await asyncio.sleep(poll_s)

    async def kv_report(self) -> dict | None:
        """The server's /debug/kv report (kvserve's), or None where it has none."""
        status, body = await self._get_json("GET", "/debug/kv")
        return body if status == 200 and "blocks" in body else None

    async def sample_kv_reports(self, reports: list[dict], interval_s: float = KV_SAMPLE_INTERVAL_S) -> None:
        """Append a /debug/kv report every interval until cancelled (none from other servers)."""
        while True:
            report = await self.kv_report()
            if report is None:
                return
            reports.append(report)
            await asyncio.sleep(interval_s)

    async def first_model(self) -> str:
        status, body = await self._get_json("GET", "/v1/models")
        if status != 200 or not body.get("data"):
            raise BenchmarkError(f"GET /v1/models returned {status}: {body}; pass --model")
        return body["data"][0]["id"]

    async def count_tokens(self, text: str) -> int:
        if self.can_tokenize:
            status, body = await self._get_json("POST", "/tokenize", {"model": self.model, "prompt": text})
            if status == 200:
                return body["count"] if "count" in body else len(body["tokens"])
            logger.warning("POST /tokenize returned %d; estimating %d chars per token", status, CHARS_PER_TOKEN)
            self.can_tokenize = False
        return max(1, round(len(text) / CHARS_PER_TOKEN))

    async def detokenize(self, token_ids: list[int]) -> str:
        status, body = await self._get_json("POST", "/detokenize", {"model": self.model, "tokens": token_ids})
        if status != 200:
            raise BenchmarkError(
                f"POST /detokenize returned {status}; random prompts on the chat endpoint need it "
                "(use --endpoint completions, which sends token ids)"
            )
        return body["prompt"]

    def _body(self, prompt: BenchPrompt) -> dict:
        body = {"model": self.model, "stream": True, "stream_options": {"include_usage": True}}
        if self.chat:
            content = prompt.prompt if not prompt.images else [
                {"type": "text", "text": prompt.prompt},
                *({"type": "image_url", "image_url": {"url": url}} for url in prompt.images)]
            body |= {"messages": [{"role": "user", "content": content}],
                     "max_completion_tokens": prompt.max_tokens}
        else:
            body |= {"prompt": prompt.prompt, "max_tokens": prompt.max_tokens}
        return body | self.sampling

    def _content(self, choice: dict) -> str:
        if self.chat:
            return (choice.get("delta") or {}).get("content") or ""
        return choice.get("text") or ""

    async def stream(self, prompt: BenchPrompt, record: RequestRecord) -> None:
        """Send one streamed request and fill in `record`'s timings and token counts."""
        content_chunks = 0
        done = False
        usage: dict = {}
        start = last = time.perf_counter()
        try:
            async with self.session.post(self.url, json=self._body(prompt), headers=self.headers) as response:
                if response.status != 200:
                    record.error = f"HTTP {response.status}: {(await response.text())[:300]}"
                    return
                async for raw_line in response.content:
                    line = raw_line.decode().strip()
                    if not line.startswith("data:"):
                        continue  # blank separators and SSE comments
                    data = line.removeprefix("data:").strip()
                    if data == "[DONE]":
                        done = True
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        record.error = f"stream error: {chunk['error']}"
                        return
                    usage = chunk.get("usage") or usage
                    choices = chunk.get("choices") or []
                    if not (choices and self._content(choices[0])):
                        continue
                    now = time.perf_counter()
                    if content_chunks == 0:
                        record.ttft_s = now - start
                    else:
                        record.itl_s.append(now - last)
                    last = now
                    content_chunks += 1
        except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, UnicodeDecodeError) as error:
            record.error = f"{type(error).__name__}: {error}"
            return
        if not done:
            record.error = "the stream ended before [DONE]"
            return
        if content_chunks == 0:
            record.error = "the stream carried no content"
            return
        record.e2e_s = last - start
        record.output_tokens = usage.get("completion_tokens") or content_chunks
        record.prompt_tokens = usage.get("prompt_tokens") or record.prompt_tokens


def arrival_offsets(num: int, request_rate: float, seed: int) -> list[float]:
    """Poisson process: exponential gaps, the first request at 0; all at 0 for rate inf."""
    if math.isinf(request_rate):
        return [0.0] * num
    rng = random.Random(seed)
    offsets = [0.0]
    for _ in range(num - 1):
        offsets.append(offsets[-1] + rng.expovariate(request_rate))
    return offsets


async def run_benchmark(
    client: OpenAIClient,
    prompts: list[BenchPrompt],
    request_rate: float,
    max_concurrency: int | None,
    seed: int,
) -> tuple[list[RequestRecord], float]:
    """All prompts at their arrival times; returns the records and the benchmark duration."""
    offsets = arrival_offsets(len(prompts), request_rate, seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    progress = tqdm(total=len(prompts), desc=f"rate {request_rate:g} req/s", unit="req")
    bench_start = time.perf_counter()

    async def send(prompt: BenchPrompt, offset: float) -> RequestRecord:
        await asyncio.sleep(max(0.0, bench_start + offset - time.perf_counter()))
        async with limit:
            record = RequestRecord(prompt.prompt_tokens, prompt.max_tokens, time.perf_counter() - bench_start)
            await client.stream(prompt, record)
        progress.update(1)
        return record

    records = await asyncio.gather(*(send(p, o) for p, o in zip(prompts, offsets)))
    duration = time.perf_counter() - bench_start
    progress.close()
    return list(records), duration


async def load_prompts(client: OpenAIClient, args: argparse.Namespace) -> list[BenchPrompt]:
    if args.dataset in RANDOM_DATASETS:
        if args.dataset == "shared-prefix":
            prompts = shared_prefix_prompts(args.num_prompts, args.num_prefixes, args.prefix_len,
                                            tuple(args.input_len), tuple(args.output_len),
                                            tuple(args.random_token_range), args.seed)
        else:
            prompts = random_prompts(args.num_prompts, tuple(args.input_len), tuple(args.output_len),
                                     tuple(args.random_token_range), args.seed)
        if client.chat:  # chat messages are text
            for prompt in prompts:
                prompt.prompt = await client.detokenize(prompt.prompt)
        if args.dataset == "random-mm":
            urls = random_image_urls(len(prompts), args.images_per_request, args.image_size, args.seed)
            for prompt, request_urls in zip(prompts, urls):
                prompt.images = request_urls
        return prompts
    return await sharegpt_prompts(args.dataset.removeprefix("sharegpt:"), args.num_prompts,
                                  args.seed, client.count_tokens)


def client_session() -> aiohttp.ClientSession:
    """One new connection per request (as vLLM's benchmark, which opens a session per
    request): reusing keep-alive connections raced llama-server closing them, and 3-4 of 32
    requests failed with "Can not write request body" at 16 streams. The
    pool does not limit concurrency: the benchmark does."""
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))


async def benchmark_from_args(args: argparse.Namespace, rates: list[float]) -> list[dict]:
    async with client_session() as session:
        client = OpenAIClient(session, args.base_url, args.api_key, args.endpoint)
        client.model = args.model or await client.first_model()
        ignore_eos = args.dataset in RANDOM_DATASETS if args.ignore_eos is None else args.ignore_eos
        # Send ignore_eos only when on, so servers without the extension still work.
        client.sampling = {"temperature": args.temperature} | ({"ignore_eos": True} if ignore_eos else {})
        prompts = await load_prompts(client, args)
        # One short request first, outside the measurement: fail fast with the server's own message.
        check_prompt = replace(prompts[0], max_tokens=min(prompts[0].max_tokens, CHECK_MAX_TOKENS))
        check = RequestRecord(check_prompt.prompt_tokens, check_prompt.max_tokens)
        await client.stream(check_prompt, check)
        if not check.success:
            raise BenchmarkError(f"the first test request failed: {check.error}")
        await client.wait_for_decode_graphs()
        config = {
            "base_url": client.base_url, "model": client.model, "endpoint": args.endpoint,
            "dataset": args.dataset, "num_prompts": args.num_prompts, "max_concurrency": args.max_concurrency,
            "seed": args.seed, "ignore_eos": ignore_eos, "temperature": args.temperature,
        } | ({"images_per_request": args.images_per_request, "image_size": "x".join(map(str, args.image_size))}
             if args.dataset == "random-mm" else {})
        results = []
        for rate in rates:
            kv_reports: list[dict] = []
            sampler = asyncio.create_task(client.sample_kv_reports(kv_reports))
            records, duration = await run_benchmark(client, prompts, rate, args.max_concurrency, args.seed)
            sampler.cancel()
            final = await client.kv_report()
            kv_cache = summarize_reports(kv_reports + [final]) if kv_reports and final else None
            metrics = compute_metrics(records, duration, args.slo_ttft_ms, args.slo_tpot_ms)
            results.append(config | {"request_rate": rate} | metrics | {"kv_cache": kv_cache}
                           | {"requests": [r.to_json() for r in records]})
        return results


def format_table(result: dict) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    lines = [
        (f"model {result['model']} · {result['endpoint']} · {result['dataset']} · "
         f"rate {result['request_rate']:g} req/s · max concurrency {result['max_concurrency'] or 'unlimited'}"),
        (f"requests: {result['completed']} completed, {result['failed']} failed; "
         f"duration {result['duration_s']:.2f} s"),
        f"tokens: {result['total_input_tokens']} input, {result['total_output_tokens']} output",
        (f"throughput: {result['request_throughput']:.2f} req/s, {result['output_throughput']:.1f} output tok/s, "
         f"{result['total_token_throughput']:.1f} total tok/s"),
    ]
    if result["goodput"] is not None:
        lines.append(f"goodput: {result['goodput']:.2f} req/s ({result['good_requests']} requests within "
                     f"TTFT <= {result['slo_ttft_ms']} ms, TPOT <= {result['slo_tpot_ms']} ms)")
    lines.append(f"{'ms':6s} {'mean':>9s} {'p50':>9s} {'p90':>9s} {'p99':>9s}")
    for name in ("ttft", "tpot", "itl", "e2e"):
        stats = result[f"{name}_ms"]
        cells = " ".join(f"{ms(stats[k]):>9s}" for k in ("mean", "p50", "p90", "p99"))
        lines.append(f"{name.upper():6s} {cells}")
    kv = result.get("kv_cache")
    if kv:
        lines.append(
            f"KV cache: peak {kv['peak_blocks_used']}/{kv['blocks_total']} blocks, internal fragmentation "
            f"{100 * kv['mean_internal_fragmentation']:.1f}% (mean), sharing saved up to "
            f"{kv['peak_sharing_bytes_saved'] / 2**20:.1f} MiB, prefix-cache hit rate "
            f"{100 * kv['prefix_cache_hit_rate']:.1f}%, {kv['preemptions']} preemptions")
    lines += [f"error: {message}" for message in result["errors"]]
    return "\n".join(lines)


def plot_sweep(results: list[dict], path: str) -> None:
    """TTFT and TPOT percentiles against output throughput, one labelled point per rate."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on servers
    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # not its font-cache chatter
    import matplotlib.pyplot as plt

    throughput = [r["output_throughput"] for r in results]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, metric in zip(axes, ("ttft", "tpot")):
        for stat, style in (("p50", "o-"), ("p99", "s--")):
            values = [r[f"{metric}_ms"][stat] for r in results]
            ax.plot(throughput, values, style, label=f"{metric.upper()} {stat}")
            if stat == "p50":
                for x, y, r in zip(throughput, values, results):
                    ax.annotate(f"{r['request_rate']:g} req/s", (x, y), textcoords="offset points",
                                xytext=(4, 6), fontsize=8)
        ax.set_xlabel("output throughput (tok/s)")
        ax.set_ylabel(f"{metric.upper()} (ms)")
        ax.grid(alpha=0.3)
        ax.legend()
    first = results[0]
    fig.suptitle(
        f"{first['model']} · {first['endpoint']} · {first['dataset']} · {first['num_prompts']} requests per rate"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _rate(text: str) -> float:
    rate = float(text)
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"request rate must be > 0 (or inf), got {text}")
    return rate


RANDOM_DATASETS = ("random", "random-mm", "shared-prefix")


def _dataset(text: str) -> str:
    if text not in RANDOM_DATASETS and not text.startswith("sharegpt:"):
        raise argparse.ArgumentTypeError(
            f"dataset must be random, random-mm, shared-prefix or sharegpt:PATH, got {text}")
    return text


def _image_size(text: str) -> tuple[int, int]:
    width, sep, height = text.lower().partition("x")
    try:
        size = (int(width), int(height))
    except ValueError:
        size = (0, 0)
    if not sep or min(size) < 1:
        raise argparse.ArgumentTypeError(f"image size must be WIDTHxHEIGHT, e.g. 1024x1024; got {text!r}")
    return size


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    server = parser.add_argument_group("server")
    server.add_argument("--base-url", default="http://127.0.0.1:8000", help="Server URL (a trailing /v1 is fine).")
    server.add_argument("--model", default=None,
                        help="Model name to request (default: the first of GET /v1/models).")
    server.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                        help="POST /v1/completions or /v1/chat/completions.")
    server.add_argument("--api-key", default=envs.OPENAI_API_KEY,
                        help="Bearer token (default: $OPENAI_API_KEY).")
    workload = parser.add_argument_group("workload")
    workload.add_argument("--dataset", type=_dataset, default="random",
                          help="random (random token ids), random-mm (random token ids plus random-noise "
                               "images, --images-per-request of --image-size each; needs --endpoint chat), "
                               "shared-prefix (--num-prefixes random prefixes of --prefix-len tokens, each "
                               "request one of them plus --input-len random tokens) "
                               "or sharegpt:PATH (first human turn as the prompt, "
                               "the reference answer's token count as max_tokens).")
    workload.add_argument("--num-prompts", type=int, default=64, help="Number of requests per rate.")
    workload.add_argument("--input-len", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"),
                          help="Random prompt length range in tokens (uniform, inclusive).")
    workload.add_argument("--output-len", type=int, nargs=2, default=[32, 128], metavar=("MIN", "MAX"),
                          help="Random max_tokens range (uniform, inclusive).")
    workload.add_argument("--random-token-range", type=int, nargs=2, default=[1000, 32000],
                          metavar=("LOW", "HIGH"),
                          help="Random prompts draw token ids uniformly from [LOW, HIGH): ordinary ids in most "
                               "vocabularies, clear of the special tokens at the bottom.")
    workload.add_argument("--num-prefixes", type=int, default=4,
                          help="shared-prefix: distinct shared prefixes (system prompts) the requests spread over.")
    workload.add_argument("--prefix-len", type=int, default=1000,
                          help="shared-prefix: tokens in each shared prefix.")
    workload.add_argument("--images-per-request", type=int, default=1,
                          help="random-mm: images in each request's chat message.")
    workload.add_argument("--image-size", type=_image_size, default=(512, 512), metavar="WxH",
                          help="random-mm: each image's size in pixels (before the model's own resizing).")
    workload.add_argument("--seed", type=int, default=0, help="Seed of the prompts and the arrival times.")
    workload.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                          help="Send ignore_eos so every request generates max_tokens "
                               "(default: on for random, off for sharegpt).")
    workload.add_argument("--temperature", type=float, default=0.0, help="Sampling temperature; 0 is greedy.")
    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", type=_rate, default=math.inf,
                      help="Poisson arrival rate in requests/s; inf sends all at once.")
    load.add_argument("--max-concurrency", type=int, default=None, help="Most requests in flight at once.")
    load.add_argument("--sweep", default=None, metavar="R1,R2,...",
                      help="Run these request rates in turn (overrides --request-rate) and plot them.")
    report = parser.add_argument_group("report")
    report.add_argument("--slo-ttft-ms", type=float, default=None, help="Goodput SLO on TTFT (W3 uses 500).")
    report.add_argument("--slo-tpot-ms", type=float, default=None, help="Goodput SLO on TPOT (W3 uses 50).")
    report.add_argument("--output-json", default=None,
                        help="Write the result (aggregate and per-request records) to this file.")
    report.add_argument("--plot", default="bench_serve_sweep.png",
                        help="With --sweep: latency-versus-throughput PNG path.")


def run_from_args(args: argparse.Namespace) -> int:
    for name, (low, high) in (("--input-len", args.input_len), ("--output-len", args.output_len)):
        if not 1 <= low <= high:
            raise ValueError(f"{name} needs 1 <= MIN <= MAX, got {low} {high}")
    if not 0 <= args.random_token_range[0] < args.random_token_range[1]:
        raise ValueError(f"--random-token-range needs 0 <= LOW < HIGH, got {args.random_token_range}")
    if args.dataset == "random-mm" and (args.endpoint != "chat" or args.images_per_request < 1):
        raise ValueError("--dataset random-mm sends images in chat messages: it needs --endpoint chat and "
                         "--images-per-request >= 1")
    if args.dataset == "shared-prefix" and (args.num_prefixes < 1 or args.prefix_len < 1):
        raise ValueError("--dataset shared-prefix needs --num-prefixes >= 1 and --prefix-len >= 1")
    if args.num_prompts < 1 or (args.max_concurrency is not None and args.max_concurrency < 1):
        raise ValueError("--num-prompts and --max-concurrency must be >= 1")
    try:
        rates = [_rate(r) for r in args.sweep.split(",")] if args.sweep else [args.request_rate]
    except (ValueError, argparse.ArgumentTypeError) as error:
        raise ValueError(f"--sweep: {error}") from error
    try:
        results = asyncio.run(benchmark_from_args(args, rates))
    except (BenchmarkError, aiohttp.ClientError) as error:
        print(f"kvserve bench serve: error: {error}", file=sys.stderr)
        return 1
    for result in results:
        print("\n" + format_table(result))
    if args.sweep:
        plot_sweep(results, args.plot)
        print(f"\nplot written to {args.plot}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"sweep": results, "plot": args.plot} if args.sweep else results[0], f, indent=2)
    return 0
