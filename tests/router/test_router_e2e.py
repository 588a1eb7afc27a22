"""`kvserve router` in front of real `kvserve serve` replicas on loopback: the openai client
sees what it sees against one replica, requests reach replicas of their model, and a client
that leaves aborts its request at the replica."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from replicas import client, launch_replicas, launch_router, scrape


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, tiny_model):
    """Two replicas serving `tiny-a` and one serving `tiny-b`."""
    servers = launch_replicas(tmp_path_factory.mktemp("replicas"), tiny_model, ["tiny-a", "tiny-a", "tiny-b"])
    yield servers
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def config_file(replicas, tmp_path_factory):
    path = tmp_path_factory.mktemp("router") / "router.yaml"
    a1, a2, b = replicas
    path.write_text(f"models:\n  tiny-a: [{a1.base_url}, {a2.base_url}]\n  tiny-b:\n    - {b.base_url}\n")
    return str(path)


@pytest.fixture(scope="module")
def router(config_file, tmp_path_factory):
    proc = launch_router(tmp_path_factory.mktemp("router-logs"), "--config", config_file)
    yield proc
    proc.stop()


def test_completions_and_chat_match_one_replica(router, replicas):
    direct, routed = client(replicas[0].base_url), client(router.base_url)
    prompt = "t10 t11 t12 t13 t14"
    for c in (direct, routed):
        assert c.models.list().data  # both answer /v1/models
    expected = direct.completions.create(model="tiny-a", prompt=prompt, max_tokens=12, temperature=0)
    got = routed.completions.create(model="tiny-a", prompt=prompt, max_tokens=12, temperature=0)
    assert got.choices[0].text == expected.choices[0].text
    assert got.usage == expected.usage
    stream = routed.completions.create(model="tiny-a", prompt=prompt, max_tokens=12, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.choices[0].text
    assert chunks[-1].usage.completion_tokens == 12

    messages = [{"role": "user", "content": "t20 t21 t22"}]
    expected_chat = direct.chat.completions.create(model="tiny-a", messages=messages, max_tokens=8, temperature=0)
    got_chat = routed.chat.completions.create(model="tiny-a", messages=messages, max_tokens=8, temperature=0)
    assert got_chat.choices[0].message.content == expected_chat.choices[0].message.content
    streamed = routed.chat.completions.create(model="tiny-a", messages=messages, max_tokens=8,
                                              temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == expected_chat.choices[0].message.content


def test_errors_match_one_replica_and_unknown_model_lists_models(router, replicas):
    for base_url in (replicas[0].base_url, router.base_url):
        with pytest.raises(openai.BadRequestError) as error:
            client(base_url).completions.create(model="tiny-a", prompt="t1", max_tokens=8, top_p=7)
        assert error.value.body["param"] == "top_p"
    with pytest.raises(openai.NotFoundError) as error:
        client(router.base_url).completions.create(model="nope", prompt="t1", max_tokens=1)
    assert "nope" in error.value.message and "tiny-a, tiny-b" in error.value.message
    response = httpx.post(f"{router.base_url}/v1/completions", content=b"{not json")
    assert response.status_code == 400


def test_models_is_the_union_and_each_model_reaches_its_replicas(router, replicas):
    assert sorted(m.id for m in client(router.base_url).models.list().data) == ["tiny-a", "tiny-b"]
    served = lambda server: scrape(server.base_url, "kvserve:request_success")
    before = [served(s) for s in replicas]
    routed = client(router.base_url)
    for _ in range(4):
        routed.completions.create(model="tiny-b", prompt="t7 t8", max_tokens=2)
        routed.completions.create(model="tiny-a", prompt="t7 t9", max_tokens=2)
    after = [served(s) for s in replicas]
    gained = [a - b for a, b in zip(after, before)]
    assert gained[2] == 4 and gained[0] + gained[1] == 4


def test_client_disconnect_aborts_the_upstream_request(router, replicas):
    aborted = lambda: sum(scrape(s.base_url, "kvserve:request_success", 'finished_reason="abort"')
                          for s in replicas[:2])
    before = aborted()
    with httpx.stream("POST", f"{router.base_url}/v1/completions",
                      json={"model": "tiny-a", "prompt": "t5", "max_tokens": 1000,
                            "ignore_eos": True, "stream": True}) as response:
        assert response.status_code == 200
        next(response.iter_lines())
    deadline = time.monotonic() + 10
    while aborted() == before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert aborted() == before + 1
