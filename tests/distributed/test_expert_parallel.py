"""Mixtures of experts over two ranks: every expert's rows split (tensor parallel) or whole
experts per rank (expert parallel, combined by all-reduce or by all_to_all) generate the
one-process tokens; an expert-parallel layer gives an fp32 reference's outputs."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from transformers import MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

from kvserve import LLM, SamplingParams

# 8 experts, top 2; Qwen2-MoE with a shared expert and a dense first layer.
SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
MODELS = {
    "mixtral": lambda: MixtralForCausalLM(MixtralConfig(
        **SMALL, num_local_experts=8, num_experts_per_tok=2, sliding_window=None)),
    "qwen2-moe": lambda: Qwen2MoeForCausalLM(Qwen2MoeConfig(
        **SMALL, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
        shared_expert_intermediate_size=80, norm_topk_prob=False, mlp_only_layers=[0])),
}


@pytest.mark.parametrize(("architecture", "expert_parallel", "dispatch"), [
    pytest.param("qwen2-moe", True, "all_to_all", id="qwen2-moe-ep-all-to-all"),
    pytest.param("qwen2-moe", True, "all_reduce", id="qwen2-moe-ep-all-reduce", marks=pytest.mark.slow),
    pytest.param("qwen2-moe", False, "auto", id="qwen2-moe-tp", marks=pytest.mark.slow),
    pytest.param("mixtral", True, "all_to_all", id="mixtral-ep-all-to-all", marks=pytest.mark.slow),
    pytest.param("mixtral", True, "all_reduce", id="mixtral-ep-all-reduce", marks=pytest.mark.slow),
    pytest.param("mixtral", False, "auto", id="mixtral-tp", marks=pytest.mark.slow),
])
def test_two_ranks_generate_the_one_process_tokens(save_hf_model, monkeypatch, architecture, expert_parallel,
                                                   dispatch):
    monkeypatch.setenv("KVSERVE_EP_DISPATCH", dispatch)  # the ranks' processes inherit it
    model_dir = save_hf_model(MODELS[architecture](), name=architecture)
    prompts = [{"prompt_token_ids": [(13 * i + j) % 256 for j in range(6 + 9 * i)]} for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    kwargs = dict(dtype="float32", kv_cache_memory="4MiB")
    expected = [o.outputs[0].token_ids for o in LLM(model_dir, **kwargs).generate(prompts, params)]
    llm = LLM(model_dir, tensor_parallel_size=2, enable_expert_parallel=expert_parallel, **kwargs)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    finally:
        llm.engine.shutdown()


def test_experts_that_do_not_divide_are_refused():
    from kvserve.config import ModelConfig
    from kvserve.model_executor.tensor_parallel import check_shardable

    config = ModelConfig("MixtralForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=6, num_experts_per_tok=2, moe_intermediate_size=96)
    with pytest.raises(ValueError, match="6 experts cannot be split over 4 ranks; use a tensor_parallel_size among 1, 2, 3, 6"):
        check_shardable(config, 4, expert_parallel=True)


def test_the_exchange_is_chosen_where_it_sends_fewer_bytes(monkeypatch):
    from kvserve.model_executor.layers.moe import use_all_to_all

    monkeypatch.delenv("KVSERVE_EP_DISPATCH", raising=False)
    # Hidden-state rows a rank sends, top 2: ring all-reduce 2 (N-1)/N T; exchange of
    # C = ceil(T/N) tokens (N-1) C (1 + 4/N). N=2: T=1 1 vs 3, T=2048 2048 vs 3072;
    # N=8: T=1 1.75 vs 10.5, T=6 10.5 vs 10.5, T=7 12.25 vs 10.5, T=2048 3584 vs 2688.
    cases = {(2, 1): False, (2, 2048): False, (8, 1): False, (8, 6): False, (8, 7): True, (8, 2048): True}
    assert {case: use_all_to_all(case[0], 2, False, case[1]) for case in cases} == cases
    assert not use_all_to_all(8, 2, True, 2048)  # a shared expert: the all-reduce is needed anyway
    assert not use_all_to_all(8, 8, False, 2048)  # Qwen3-MoE's top 8: 3584 vs 5376
    monkeypatch.setenv("KVSERVE_EP_DISPATCH", "all_to_all")
    assert use_all_to_all(2, 2, True, 1)
    monkeypatch.setenv("KVSERVE_EP_DISPATCH", "alltoall")
    with pytest.raises(ValueError, match="expected auto, all_to_all or all_reduce"):
        use_all_to_all(2, 2, False, 1)


# An expert-parallel layer on two gloo ranks (run inside tests/distributed/test_tensor_parallel.py's
# spawned collectives test, which pays for the processes once): (name, tokens, shared expert
# rows, routing only to rank 0's experts, dispatch).
LAYER_CASES = [
    ("uneven", 7, 0, False, "all_to_all"),
    ("rank 1 receives nothing", 5, 0, True, "all_to_all"),
    ("rank 1 sends nothing", 1, 0, False, "all_to_all"),
    ("shared expert", 6, 20, False, "all_to_all"),
    ("all-reduce", 7, 20, False, "all_reduce"),
]
HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 16, 24, 8, 2


def _layer_case(tokens: int, shared: int, skewed: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(a SparseMoE's weights, its input), the same in every process."""
    generator = torch.Generator().manual_seed(1000 * tokens + shared)
    def rand(*shape):
        return torch.randn(*shape, generator=generator)

    state = {"gate.weight": rand(EXPERTS, HIDDEN)}
    for e in range(EXPERTS):
        state[f"experts.{e}.gate_up_proj.weight"] = rand(2 * INTERMEDIATE, HIDDEN) / 4
        state[f"experts.{e}.down_proj.weight"] = rand(HIDDEN, INTERMEDIATE) / 4
    if shared:
        state["shared_expert.gate_up_proj.weight"] = rand(2 * shared, HIDDEN) / 4
        state["shared_expert.down_proj.weight"] = rand(HIDDEN, shared) / 4
        state["shared_expert_gate.weight"] = rand(1, HIDDEN)
    x = rand(tokens, HIDDEN)
    if skewed:  # positive inputs, positive logits for experts 0-3 only: rank 1's experts idle
        x = x.abs()
        gate = state["gate.weight"].abs()
        gate[EXPERTS // 2:] *= -1
        state["gate.weight"] = gate
    return state, x


def _reference(state: dict[str, torch.Tensor], x: torch.Tensor, renormalize: bool) -> tuple[torch.Tensor, list]:
    """The layer token by token in fp32 (and which experts each token chose)."""
    def mlp(prefix, row):
        gate, up = (state[f"{prefix}.gate_up_proj.weight"] @ row).chunk(2)
        return state[f"{prefix}.down_proj.weight"] @ (F.silu(gate) * up)

    out, chosen = torch.zeros_like(x), []
    for t, row in enumerate(x):
        weights, experts = torch.topk(torch.softmax(state["gate.weight"] @ row, dim=-1), TOP_K)
        if renormalize:
            weights = weights / weights.sum()
        chosen.append(experts.tolist())
        for weight, expert in zip(weights, experts.tolist()):
            out[t] += weight * mlp(f"experts.{expert}", row)
        if "shared_expert_gate.weight" in state:
            out[t] += torch.sigmoid(state["shared_expert_gate.weight"] @ row) * mlp("shared_expert", row)
    return out, chosen


def expert_parallel_layer_outputs(group, device: torch.device = torch.device("cpu")) -> list[tuple[torch.Tensor, bool]]:
    """Each LAYER_CASES layer's output on this rank (on the CPU), expert parallel over
    `group` on `device` (and whether it exchanged its tokens)."""
    from kvserve.model_executor.layers.moe import SparseMoE
    from kvserve.model_executor.tensor_parallel import _shard_experts

    outputs = []
    for _, tokens, shared, skewed, dispatch in LAYER_CASES:
        state, x = _layer_case(tokens, shared, skewed)
        moe = SparseMoE(HIDDEN, INTERMEDIATE, EXPERTS, TOP_K, renormalize=not shared,
                        shared_intermediate_size=shared)
        moe.load_state_dict(state)
        os.environ["KVSERVE_EP_DISPATCH"] = dispatch
        _shard_experts(moe, group, expert_parallel=True)
        moe, x = moe.to(device), x.to(device)
        exchanges = []
        group.all_to_all_single = lambda *args, _exchange=type(group).all_to_all_single: (
            exchanges.append(1) or _exchange(group, *args))
        with torch.no_grad():
            outputs.append((moe(x).cpu(), bool(exchanges)))
        del group.all_to_all_single
    return outputs


def check_expert_parallel_layers(outputs: list[tuple[torch.Tensor, bool]]) -> None:
    for (name, tokens, shared, skewed, dispatch), (out, exchanged) in zip(LAYER_CASES, outputs, strict=True):
        state, x = _layer_case(tokens, shared, skewed)
        expected, chosen = _reference(state, x, renormalize=not shared)
        assert exchanged == (dispatch == "all_to_all"), name
        if skewed:
            assert max(max(c) for c in chosen) < EXPERTS // 2, name
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-5, msg=name)


def _nccl_layers(rank: int, world_size: int, init_method: str, result_file: str) -> None:
    from kvserve.distributed import parallel_state as ps

    device = torch.device("cuda", rank)
    ps.init_distributed_environment(world_size, rank, init_method, device)
    ps.initialize_model_parallel(world_size)
    outputs = expert_parallel_layer_outputs(ps.get_tp_group(), device)
    torch.save(outputs, f"{result_file}.{rank}")
    ps.destroy_model_parallel()


@pytest.mark.gpu
def test_expert_parallel_layers_on_two_gpus(tmp_path):
    """The same layers over NCCL: the counts, rows and outputs exchanged on the devices."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    from tests.distributed.test_tensor_parallel import _spawn

    result_file = str(tmp_path / "layers.pt")
    _spawn(_nccl_layers, 2, result_file)
    for rank in range(2):
        check_expert_parallel_layers(torch.load(f"{result_file}.{rank}"))
