"""`kvserve serve --skip-tokenizer-init`: completions from token ids, with the same tokens as
the offline engine with its tokenizer and no text; logprob entries name token ids; whatever
needs text gets a 400 that says why, and the server keeps serving."""

from __future__ import annotations

import httpx
import pytest
from server_process import launch_server

from kvserve import SamplingParams

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = launch_server(tmp_path_factory.mktemp("server_without_tokenizer"), "--max-model-len", "1024",
                         "--skip-tokenizer-init")
    yield proc
    proc.stop()


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json={"model": MODEL, **body}, timeout=60)


def test_token_id_completion_equals_offline_engine(server, reference_llm):
    prompt = reference_llm.get_tokenizer()("The capital of France is").input_ids
    reference = reference_llm.generate({"prompt_token_ids": prompt},
                                       SamplingParams(temperature=0, max_tokens=8, logprobs=0))[0].outputs[0]
    response = _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                                  "logprobs": 0})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["text"] == ""
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in reference.token_ids]
    assert choice["finish_reason"] == reference.finish_reason


@pytest.mark.parametrize(("path", "body", "param", "needs"), [
    ("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 2}, None, "pass token ids"),
    ("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2, "stop": ["."]}, None, "stop strings"),
    ("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2, "echo": True}, "echo", "echo of token ids"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}, "messages", "chat needs one"),
    ("/tokenize", {"prompt": "Hi"}, "prompt", "tokenizing a prompt"),
    ("/detokenize", {"tokens": [1, 2]}, "tokens", "detokenizing"),
])
def test_what_needs_text_is_refused_with_the_reason(server, path, body, param, needs):
    response = _post(server, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "no tokenizer" in error["message"] and needs in error["message"]
    if param is not None:
        assert error["param"] == param
    after = _post(server, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2})
    assert after.status_code == 200
