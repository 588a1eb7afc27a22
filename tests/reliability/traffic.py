"""Mixed traffic for the soak suite: valid requests (streamed or not) among malformed and
hostile ones, abandoned streams, clients that time out, and slow connections; and what the
run saw, for the tests to assert on."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field

import httpx

MODEL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "Name a color."}]

# (path, body): every one must get a 4xx, never a 5xx. Strings and bytes go out verbatim.
MALFORMED: list[tuple[str, object]] = [
    ("/v1/completions", '{"prompt": "x",'),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}),
    ("/v1/completions", {"prompt": 5}),
    ("/v1/completions", {"prompt": "x", "top_p": 7}),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}),
    ("/v1/completions", {"prompt": "hello " * 3000, "max_tokens": 10}),
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/chat/completions", {"message": CHAT}),
    ("/v1/completions", b'{"prompt": "\xff\xfe\xfd"}'),
    ("/v1/completions", "[" * 50_000 + "]" * 50_000),
    ("/v1/completions", {}),
    ("/v1/completions", {"prompt": "x", "n": 9223372036854775808}),
    ("/v1/completions", {"prompt": "x", "seed": 2**64}),
    ("/v1/completions", {"prompt": "x", "seed": 2**64 - 1, "n": 2}),
    ("/v1/completions", '{"prompt": "x", "temperature": NaN}'),
    ("/v1/completions", '{"prompt": "x", "temperature": Infinity}'),
    ("/v1/completions", '{"prompt": "x", "logit_bias": {"3": -Infinity}}'),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}),
    ("/v1/completions", {"prompt": [1, 99999999]}),
    ("/detokenize", {"tokens": [2**70]}),
]


@dataclass
class Report:
    statuses: list[int] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # what went wrong with valid requests
    valid_done: int = 0
    valid_latencies_s: list[float] = field(default_factory=list)  # send to last byte, completed ones

    def server_errors(self) -> list[int]:
        return [s for s in self.statuses if s >= 500]

    def valid_latency_percentile(self, percent: float) -> float:
        ordered = sorted(self.valid_latencies_s)  # nearest rank
        return ordered[max(0, math.ceil(len(ordered) * percent / 100) - 1)]


async def _valid(client: httpx.AsyncClient, rng: random.Random, report: Report) -> None:
    chat = rng.random() < 0.3
    stream = rng.random() < 0.5
    body: dict = {"model": MODEL, "max_tokens": rng.randint(2, 6), "temperature": rng.choice([0, 0.8]),
                  "stream": stream}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body |= {"messages": CHAT} if chat else {"prompt": f"Request {rng.randint(0, 10**6)}:"}
    sent = time.monotonic()
    try:
        if stream:
            async with client.stream("POST", path, json=body) as response:
                report.statuses.append(response.status_code)
                payloads = [line[6:] async for line in response.aiter_lines() if line.startswith("data: ")]
            finished = [c["choices"][0]["finish_reason"] for c in map(json.loads, payloads[:-1])
                        if c.get("choices")]
            ok = response.status_code == 200 and payloads[-1] == "[DONE]" and finished[-1] in ("stop", "length")
        else:
            response = await client.post(path, json=body)
            report.statuses.append(response.status_code)
            ok = (response.status_code == 200
                  and response.json()["choices"][0]["finish_reason"] in ("stop", "length"))
    except httpx.HTTPError as error:
        report.failures.append(f"{path} {body}: {error!r}")
        return
    if ok:
        report.valid_done += 1
        report.valid_latencies_s.append(time.monotonic() - sent)
    else:
        report.failures.append(f"{path} {body}: {response.status_code}")


async def _malformed(client: httpx.AsyncClient, rng: random.Random, report: Report) -> None:
    path, body = rng.choice(MALFORMED)
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    response = await client.post(path, content=content, headers={"content-type": "application/json"})
    report.statuses.append(response.status_code)


async def _abandoned_stream(client: httpx.AsyncClient) -> None:
    body = {"model": MODEL, "prompt": "A long tale:", "max_tokens": 200, "ignore_eos": True, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        lines = response.aiter_lines()
        await anext(lines)  # one chunk, then the client goes away


async def _client_timeout(base_url: str) -> None:
    body = {"model": MODEL, "prompt": "A long tale:", "max_tokens": 200, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=base_url, timeout=0.5) as impatient:
        try:
            await impatient.post("/v1/completions", json=body)
        except httpx.TimeoutException:
            pass


async def _slow_connection(base_url: str, partial_body: bool) -> None:
    host, port = base_url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    if partial_body:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{")
    else:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    await writer.drain()
    await reader.read()  # until the server closes it
    writer.close()


async def run(base_url: str, num_requests: int, concurrency: int, num_abandoned: int,
              num_timeouts: int, num_slow: int, seed: int = 0) -> Report:
    rng = random.Random(seed)
    report = Report()
    limit = asyncio.Semaphore(concurrency)
    # Pooled connections expire before the server's idle limit (the suite's --header-read-timeout
    # is 1-2 s), as a client tuned to its server would: the server may close one idle longer.
    limits = httpx.Limits(max_connections=concurrency + num_abandoned, keepalive_expiry=0.5)
    async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as client:

        async def one() -> None:
            async with limit:
                if rng.random() < 0.7:
                    await _valid(client, rng, report)
                else:
                    await _malformed(client, rng, report)

        await asyncio.gather(
            *(one() for _ in range(num_requests)),
            *(_abandoned_stream(client) for _ in range(num_abandoned)),
            *(_client_timeout(base_url) for _ in range(num_timeouts)),
            *(_slow_connection(base_url, i % 2 == 1) for i in range(num_slow)),
        )
    return report


def resident_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
