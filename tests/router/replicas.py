"""A tiny random Llama model and `kvserve serve` / `kvserve router` processes on loopback."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import openai
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from tests.entrypoints.server_process import ServerProcess, _free_port, launch_server

VOCAB_SIZE = 512
CHAT_TEMPLATE = ("{% for m in messages %}t3 {{ m['content'] }} t4 {% endfor %}"
                 "{% if add_generation_prompt %}t5 {% endif %}")


def save_tiny_model(directory: str) -> str:
    """Two layers of width 64: it loads in a moment; words `t0`..`t511` are its tokens."""
    import torch

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB_SIZE)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="t2",
                            chat_template=CHAT_TEMPLATE).save_pretrained(directory)
    return directory


def launch_replicas(log_dir, model_dir: str, names: list[str], *args: str) -> list[ServerProcess]:
    """One `kvserve serve` per name (its served model name), started side by side."""
    with ThreadPoolExecutor(len(names)) as pool:
        return list(pool.map(lambda name: launch_server(
            log_dir, "--model", model_dir, "--served-model-name", name, "--kv-cache-memory", "32MiB",
            *args), names))


@dataclass
class RouterProcess(ServerProcess):
    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def launch_router(log_dir, *args: str, wait_healthy: bool = True) -> RouterProcess:
    port = _free_port()
    log_path = os.path.join(str(log_dir), f"router-{port}.log")
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "kvserve.entrypoints.cli", "router", "--port", str(port),
             "--health-check-interval", "0.5", *args],
            stdout=log, stderr=subprocess.STDOUT)
    router = RouterProcess(process, f"http://127.0.0.1:{port}", log_path, False)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"router exited with {process.returncode}:\n{router.log()}")
        try:
            status = httpx.get(f"{router.base_url}/health", timeout=5).status_code
            if status == 200 or not wait_healthy:
                return router
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    router.stop()
    raise RuntimeError(f"router did not become healthy:\n{router.log()}")


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def scrape(base_url: str, name: str, label: str = "") -> float:
    """Sum of a metric's samples (a counter's `_total` series) on a server's /metrics, those
    carrying `label` (e.g. 'finished_reason="abort"') when given."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        series = line.split("{")[0].split(" ")[0]
        if series in (name, name + "_total") and label in line:
            total += float(line.rsplit(" ", 1)[1])
    return total
