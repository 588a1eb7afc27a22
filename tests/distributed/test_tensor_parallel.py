"""Tensor parallelism on real gloo process groups: the collectives, and a model sharded over
two processes that replay an engine's recorded steps (broadcast by rank 0, as the driver
will) to the unsharded model's logits and tokens."""

from __future__ import annotations

import multiprocessing
import pickle
import socket

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvserve import LLM, SamplingParams
from tests.conftest import randomize, save_tokenizer

# Vocabulary not a multiple of 64: the vocab-parallel padding is exercised.
TINY = dict(vocab_size=250, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256)
ENGINE_KWARGS = dict(kv_cache_memory="4MiB", block_size=4, max_num_batched_tokens=24,
                     attention_backend="torch", enable_prefix_caching=True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spawn(target, world_size: int, *args) -> None:
    """Runs target(rank, world_size, init_method, *args) in world_size fresh processes. They
    fork from a server process that has imported this module (torch, transformers, kvserve)
    once, rather than each importing it anew (~4 s apiece on 2 cores); nothing in that server
    has started a thread, which forking needs."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    processes = [context.Process(target=target, args=(rank, world_size, init_method, *args))
                 for rank in range(world_size)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=300)
    assert [p.exitcode for p in processes] == [0] * world_size


# Rows each rank sends to rank 0 and rank 1: uneven, then rank 1 receiving nothing.
ALL_TO_ALL_SPLITS = [[[1, 3], [2, 0]], [[2, 0], [1, 0]]]


def _collectives(rank: int, world_size: int, init_method: str, result_file: str) -> None:
    from kvserve.distributed import parallel_state as ps
    from tests.distributed.test_expert_parallel import expert_parallel_layer_outputs

    ps.init_distributed_environment(world_size, rank, init_method, torch.device("cpu"))
    ps.initialize_model_parallel(world_size)
    group = ps.get_tp_group()
    summed = group.all_reduce(torch.full((3,), float(rank + 1)))
    gathered = group.all_gather(torch.full((2, 1), float(rank)), dim=1)
    plan = group.broadcast_object({"step": 7, "ids": list(range(rank, rank + 3))} if rank == 0 else None)
    exchanged = []
    for splits in ALL_TO_ALL_SPLITS:
        sent = splits[rank]
        received = [splits[source][rank] for source in range(world_size)]
        rows = torch.tensor([[100.0 * rank + i, -i] for i in range(sum(sent))])
        there = group.all_to_all_single(rows, received, sent)
        back = group.all_to_all_single(there, sent, received)
        exchanged.append((there, back))
    counts = group.all_to_all_single(torch.tensor([10 * rank, 10 * rank + 1]))
    layers = expert_parallel_layer_outputs(group)
    with open(f"{result_file}.{rank}", "wb") as f:
        pickle.dump((summed, gathered, plan, exchanged, counts, layers), f)
    ps.destroy_model_parallel()


def test_collectives_on_two_processes(tmp_path):
    from tests.distributed.test_expert_parallel import check_expert_parallel_layers

    result_file = str(tmp_path / "result.pkl")
    _spawn(_collectives, 2, result_file)
    results = [pickle.loads(open(f"{result_file}.{rank}", "rb").read()) for rank in range(2)]
    summed, gathered, plan = results[1][:3]
    assert summed.tolist() == [3.0, 3.0, 3.0]
    assert gathered.tolist() == [[0.0, 1.0], [0.0, 1.0]]
    assert plan == {"step": 7, "ids": [0, 1, 2]}
    for case, splits in enumerate(ALL_TO_ALL_SPLITS):
        for rank in range(2):
            # What reaches `rank`: each source's block for it, sources in order, rows in order.
            expected = []
            for source in range(2):
                first = sum(splits[source][:rank])
                expected += [[100.0 * source + i, -i] for i in range(first, first + splits[source][rank])]
            there, back = results[rank][3][case]
            assert there.reshape(-1, 2).tolist() == expected
            assert back.reshape(-1, 2).tolist() == [[100.0 * rank + i, -i] for i in range(sum(splits[rank]))]
    assert [results[rank][4].tolist() for rank in range(2)] == [[0, 10], [1, 11]]
    for rank in range(2):
        check_expert_parallel_layers(results[rank][5])


@pytest.fixture(scope="module", params=[True, pytest.param(False, marks=pytest.mark.slow)], ids=["tied", "untied"])
def tiny_dir(request, tmp_path_factory):
    return _save_tiny(tmp_path_factory, tie_word_embeddings=request.param)


def _save_tiny(tmp_path_factory, **overrides) -> str:
    model = LlamaForCausalLM(LlamaConfig(**{**TINY, **overrides}))
    randomize(model, seed=0)
    directory = str(tmp_path_factory.mktemp("tiny"))
    model.save_pretrained(directory)
    save_tokenizer(directory, TINY["vocab_size"])
    return directory


def _record(model_dir: str) -> tuple[list[bytes], list[torch.Tensor], list[list], int]:
    """An engine run whose steps mix chunked prefills, a prefix hit and decodes; and its
    number of KV blocks (the block ids the steps use)."""
    llm = LLM(model_dir, dtype="float32", **ENGINE_KWARGS)
    runner = llm.engine.core.runner
    steps, logits, tokens = [], [], []
    execute, forward = runner.execute, runner.forward

    def recording_execute(sched):
        steps.append(pickle.dumps(sched))
        out = execute(sched)
        tokens.append([(s.seq_id, s.token_ids) for s in out.sampled])
        return out

    def recording_forward(sched):
        result = forward(sched)
        logits.append(result.sample_logits.clone())
        return result

    runner.execute, runner.forward = recording_execute, recording_forward
    shared = list(range(3, 40))
    prompts = [shared + [41, 42], shared + [43], list(range(100, 131)), [7, 8, 9]]
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=10))
    return steps, logits, tokens, runner.num_blocks


def _replay(rank: int, world_size: int, init_method: str, model_dir: str, num_blocks: int,
            steps_file: str, result_file: str) -> None:
    """A worker: load, shard, then run every step rank 0 broadcasts."""
    from kvserve.config import CacheConfig, SchedulerConfig
    from kvserve.distributed import parallel_state as ps
    from kvserve.model_executor.loader import load_model
    from kvserve.model_executor.model_runner import ModelRunner
    from kvserve.model_executor.tensor_parallel import shard_model

    torch.set_num_threads(1)
    ps.init_distributed_environment(world_size, rank, init_method, torch.device("cpu"))
    ps.initialize_model_parallel(world_size)
    group = ps.get_tp_group()
    loaded = load_model(model_dir, dtype=torch.float32)
    config = shard_model(loaded.model, group)
    runner = ModelRunner(loaded.model, config, CacheConfig(block_size=4, num_blocks=num_blocks),
                         SchedulerConfig(max_num_batched_tokens=24), torch.device("cpu"), "torch",
                         max_model_len=256)
    steps = pickle.loads(open(steps_file, "rb").read()) if rank == 0 else None
    num_steps = group.broadcast_object(None if steps is None else len(steps))
    logits, tokens = [], []
    forward = runner.forward

    def recording_forward(sched):
        result = forward(sched)
        logits.append(result.sample_logits.clone())
        return result

    runner.forward = recording_forward
    for i in range(num_steps):
        sched = pickle.loads(group.broadcast_object(None if steps is None else steps[i]))
        out = runner.execute(sched)
        tokens.append([(s.seq_id, s.token_ids) for s in out.sampled])
    if rank == 0:
        with open(result_file, "wb") as f:
            pickle.dump((logits, tokens), f)
    ps.destroy_model_parallel()


def test_two_ranks_replay_the_unsharded_models_steps(tiny_dir, tmp_path):
    _replay_matches(tiny_dir, 2, tmp_path)


@pytest.mark.slow
def test_ranks_beyond_the_kv_heads_hold_copies_of_them(tmp_path_factory, tmp_path):
    # 8 query heads and 2 KV heads over 4 ranks: each KV head lives on two ranks.
    model_dir = _save_tiny(tmp_path_factory, num_key_value_heads=2, tie_word_embeddings=True)
    _replay_matches(model_dir, 4, tmp_path)


def _replay_matches(tiny_dir: str, world_size: int, tmp_path) -> None:
    steps, expected_logits, expected_tokens, num_blocks = _record(tiny_dir)
    assert any(sched_has_prefix_hit(pickle.loads(s)) for s in steps)
    steps_file, result_file = str(tmp_path / "steps.pkl"), str(tmp_path / "result.pkl")
    with open(steps_file, "wb") as f:
        pickle.dump(steps, f)
    _spawn(_replay, world_size, tiny_dir, num_blocks, steps_file, result_file)
    logits, tokens = pickle.loads(open(result_file, "rb").read())
    assert tokens == expected_tokens
    assert len(logits) == len(expected_logits)
    for step, (got, want) in enumerate(zip(logits, expected_logits)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"step {step}")


def sched_has_prefix_hit(sched) -> bool:
    return any(new.num_computed_tokens > 0 for new in sched.new_seqs)


def test_heads_that_do_not_split_are_refused():
    from dataclasses import replace

    from kvserve.config import ModelConfig
    from kvserve.model_executor.tensor_parallel import check_shardable

    config = ModelConfig("LlamaForCausalLM", vocab_size=250, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=8)
    with pytest.raises(ValueError, match="8 attention heads cannot be split over 3 ranks; use a "
                                         "tensor_parallel_size among 1, 2, 4, 8"):
        check_shardable(config, 3)
    with pytest.raises(ValueError, match="4 KV heads can be neither split over nor replicated on 6 ranks"):
        check_shardable(replace(config, num_attention_heads=12, intermediate_size=96), 6)
    check_shardable(config, 8)  # 8 query heads, 4 KV heads, each held by two ranks


def test_engine_with_two_ranks_generates_the_same_tokens(tiny_dir):
    prompts = [{"prompt_token_ids": [(7 * i + j) % 250 for j in range(5 + 9 * i)]} for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    kwargs = dict(dtype="float32", kv_cache_memory="4MiB", max_num_batched_tokens=40)
    expected = [o.outputs[0].token_ids for o in LLM(tiny_dir, **kwargs).generate(prompts, params)]
    llm = LLM(tiny_dir, tensor_parallel_size=2, **kwargs)
    try:
        assert llm.engine.core.runner.num_blocks > 0
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    finally:
        llm.engine.shutdown()


def test_int4_ranks_generate_the_unsharded_int4_models_tokens(tmp_path_factory):
    # 32-wide groups: every rank's share of o_proj's and down_proj's columns starts on a group
    # boundary, so the ranks quantize exactly the groups one process would.
    model_dir = _save_tiny(tmp_path_factory, intermediate_size=128, tie_word_embeddings=False)
    prompts = [{"prompt_token_ids": [(5 * i + j) % 250 for j in range(4 + 7 * i)]} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kwargs = dict(dtype="float32", kv_cache_memory="4MiB", quantization="int4",
                  quantization_config={"group_size": 32})
    expected = [o.outputs[0].token_ids for o in LLM(model_dir, **kwargs).generate(prompts, params)]
    llm = LLM(model_dir, tensor_parallel_size=2, **kwargs)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("tiny_dir", [True], indirect=True, ids=["tied"])
def test_what_one_process_alone_can_do_is_refused_by_name(tiny_dir):
    with pytest.raises(ValueError, match="speculative decoding"):
        LLM(tiny_dir, tensor_parallel_size=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="quantization='gguf'"):
        LLM(tiny_dir, tensor_parallel_size=2, quantization="gguf")
    with pytest.raises(RuntimeError, match="rank .* failed to start.*3 ranks"):
        LLM(tiny_dir, tensor_parallel_size=3, dtype="float32")


def _spawned_children() -> list:
    import psutil

    return [child for child in psutil.Process().children()
            if child.is_running() and "spawn_main" in " ".join(child.cmdline())]


@pytest.mark.parametrize("tiny_dir", [True], indirect=True, ids=["tied"])
def test_a_dead_rank_fails_the_step_and_nothing_is_left_behind(tiny_dir):
    import signal
    import time

    before = {child.pid for child in _spawned_children()}
    llm = LLM(tiny_dir, tensor_parallel_size=2, dtype="float32", kv_cache_memory="4MiB")
    engine = llm.engine
    engine.add_request("r", {"prompt_token_ids": list(range(3, 20))},
                       SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    engine.step()
    ranks = [child for child in _spawned_children() if child.pid not in before]
    assert len(ranks) == 2
    ranks[1].send_signal(signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"tensor-parallel .*rank 1 exited \(code -9\)"):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - start < 10
    engine.shutdown()
    for rank in ranks:
        rank.wait(timeout=15)


@pytest.mark.slow
def test_serve_defaults_on_three_ranks_generate_the_one_process_text():
    """The embedded GGUF (9 heads, 3 KV heads) with quantization=auto: each rank quantizes
    its share by the CPU plan (int4 groups of 32 that start on its own columns)."""
    params = SamplingParams(temperature=0, max_tokens=24)
    prompts = ["The capital of France is", "Write a haiku about the sea:"]
    expected = [o.outputs[0].text for o in LLM(kv_cache_memory="64MiB", max_model_len=1024).generate(prompts, params)]
    llm = LLM(kv_cache_memory="64MiB", max_model_len=1024, tensor_parallel_size=3)
    try:
        assert [o.outputs[0].text for o in llm.generate(prompts, params)] == expected
    finally:
        llm.engine.shutdown()
