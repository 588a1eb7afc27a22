"""LoRA adapters through the OpenAI server, with the openai client: --lora-modules, /v1/models,
selecting an adapter by model name, hot load and unload, 404s, host-cache eviction, metrics;
outputs equal the offline engine's with the same adapter."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.model_executor.loader import load_model
from tests.entrypoints.server_process import launch_server
from tests.lora.tiny_model import save_adapters, save_tiny_llama

PROMPT = [5, 17, 33, 8, 91, 4, 60]
MAX_TOKENS = 6
API_KEY = "secret"


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("lora-server")
    base = save_tiny_llama(str(directory / "model"))
    adapters = save_adapters(base, str(directory), [4, 8, 16])
    server = launch_server(
        directory, "--model", str(directory / "model"), "--enable-lora", "--max-loras", "2", "--max-cpu-loras", "2",
        "--lora-modules", f"a1={adapters[0].lora_path}",
        json.dumps({"name": "a2", "path": adapters[1].lora_path, "base_model_name": "model"}),
        "--allow-runtime-lora-updating", "--api-key", API_KEY, "--block-size", "4",
    )
    yield server, directory, adapters
    server.stop()


def reference(directory, adapters) -> dict[str | None, list[int]]:
    """Greedy ids offline, per adapter (None: the base model)."""
    llm = LLM(loaded=load_model(str(directory / "model"), dtype=torch.float32), enable_lora=True,
              kv_cache_memory="16MiB", block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    loras = [None, *adapters]
    outputs = llm.generate([{"prompt_token_ids": PROMPT}] * len(loras), params, lora_request=loras)
    return {None if lora is None else lora.lora_name: list(o.outputs[0].token_ids) for lora, o in zip(loras, outputs)}


def complete(client: openai.OpenAI, model: str) -> list[int]:
    response = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
                                         logprobs=1, extra_body={"ignore_eos": True})
    assert response.model == model
    return [int(token.removeprefix("t")) for token in response.choices[0].logprobs.tokens]


def load(server, name: str, path: str) -> int:
    return post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path}).status_code


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=60)


def test_lora_server(lora_server) -> None:
    server, directory, adapters = lora_server
    expected = reference(directory, adapters)
    expected["a1"], expected["a2"], expected["a3"] = (expected.pop(f"adapter{i}") for i in (1, 2, 3))
    assert len({tuple(ids) for ids in expected.values()}) == 4  # every adapter changes the output
    client = server.client(API_KEY)

    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"model", "a1", "a2"}
    assert models["a1"].parent == "model" and models["a2"].parent == "model" and models["model"].parent is None

    assert complete(client, "model") == expected[None]
    assert complete(client, "a1") == expected["a1"]
    assert complete(client, "a2") == expected["a2"]
    with pytest.raises(openai.NotFoundError) as error:
        complete(client, "a3")
    assert "`a3`" in error.value.body["message"] and error.value.body["code"] == "model_not_found"

    # Hot load: a third adapter, with two device slots and room for two on the host.
    assert load(server, "a3", adapters[2].lora_path) == 200
    assert {m.id for m in client.models.list().data} == {"model", "a1", "a2", "a3"}
    assert complete(client, "a3") == expected["a3"]
    # a1 was evicted from the host cache (least recently used): it is read again.
    assert complete(client, "a1") == expected["a1"]
    assert complete(client, "a2") == expected["a2"]
    assert "evicted adapter" in server.log()

    # Bad loads are refused; the server keeps serving.
    clash = post(server, "/v1/load_lora_adapter", {"lora_name": "model", "lora_path": adapters[0].lora_path})
    assert clash.status_code == 400 and "base model" in clash.json()["error"]["message"]
    missing = post(server, "/v1/load_lora_adapter", {"lora_name": "ghost", "lora_path": str(directory / "nowhere")})
    assert missing.status_code == 400 and "'ghost'" in missing.json()["error"]["message"]
    assert missing.json()["error"]["param"] == "lora_path"
    assert load(server, "a2", adapters[0].lora_path) == 400
    no_key = httpx.post(f"{server.base_url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "y"})
    assert no_key.status_code == 401

    metrics = httpx.get(f"{server.base_url}/metrics").text
    assert "kvserve:lora_requests_info{" in metrics and 'max_lora="2"' in metrics

    # Unload: gone from /v1/models, and requests for it get 404.
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "a3"}).status_code == 200
    assert {m.id for m in client.models.list().data} == {"model", "a1", "a2"}
    with pytest.raises(openai.NotFoundError):
        complete(client, "a3")
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "a3"}).status_code == 404
    # Loaded again under the same name: served again (a new id, so no stale prefix-cache hits).
    assert load(server, "a3", adapters[0].lora_path) == 200
    assert complete(client, "a3") == expected["a1"]
    assert complete(client, "model") == expected[None]
