"""`kvserve plan` against hand-computed sizes, and against the blocks the engine allocates."""

from __future__ import annotations

import json

import pytest

from kvserve.entrypoints.cli import main
from kvserve.planning.capacity import PlanOptions, plan
from kvserve.planning.devices import GiB, KNOWN_GPUS, DeviceSpec
from kvserve.planning.plan_cli import model_shape
from kvserve.planning.suggest import suggestions

# A CPU with fixed ceilings, so that nothing is measured.
CPU = DeviceSpec("cpu:16", "cpu", 16 * GiB, 20e9, 100e9, "test")

LLAMA_70B = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 8192,
    "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
    "num_key_value_heads": 8, "max_position_embeddings": 131072, "tie_word_embeddings": False,
}


@pytest.fixture
def llama70b(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA_70B))
    return model_shape(None, None, str(path))[0]


def test_llama70b_kv_per_token_and_request(llama70b):
    # 2 (K and V) x 80 layers x 8 KV heads x 128 head dim x 2 bytes (bf16).
    p = plan(llama70b, "70b", KNOWN_GPUS["h100-80gb"], PlanOptions(input_len=4000, output_len=96))
    assert p.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2 == 327_680
    assert p.request_kv_bytes_total == 327_680 * 4096 == 1_342_177_280  # 1.34 GB, not 6.7
    # Parameters: 2 x vocab x hidden (untied) + 80 x (q, k, v, o, gate, up, down, 2 norms) + norm.
    layer = 8192 * 8192 * 2 + 8192 * 1024 * 2 + 3 * 8192 * 28672 + 2 * 8192
    assert p.weight_bytes == 2 * (2 * 128256 * 8192 + 80 * layer + 8192) == 141_107_412_992
    assert not p.fits  # 141 GB of bf16 weights on an 80 GB card


def test_tensor_parallel_shares_per_rank(llama70b):
    p = plan(llama70b, "70b", KNOWN_GPUS["h200"], PlanOptions(tensor_parallel_size=8))
    assert p.kv_bytes_per_token == 2 * 80 * 1 * 128 * 2  # one KV head a rank
    # A rank: 8 query heads, 1 KV head, 3584 MLP rows, 16,064 vocabulary rows (128,256 padded
    # to a multiple of 64 x 8); norms whole.
    layer = 8192 * 1024 * 2 + 8192 * 128 * 2 + 3 * 8192 * 3584 + 2 * 8192
    assert p.weight_bytes == 2 * (2 * 16064 * 8192 + 80 * layer + 8192)
    assert p.fits


def test_tensor_parallel_mixture_of_experts_splits_every_expert(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({
        "architectures": ["MixtralForCausalLM"], "vocab_size": 32000, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2}))
    config = model_shape(None, None, str(path))[0]
    p = plan(config, "mixtral", KNOWN_GPUS["h200"], PlanOptions(tensor_parallel_size=2))
    # A rank: 16 query and 4 KV heads of 128, the whole router, half the rows of each of the
    # 8 experts (7,168), 16,000 vocabulary rows (32,000 is a multiple of 64 x 2).
    layer = 4096 * 2048 * 2 + 4096 * 512 * 2 + 4096 * 8 + 8 * 3 * 4096 * 7168 + 2 * 4096
    assert p.weight_bytes == 2 * (2 * 16000 * 4096 + 32 * layer + 4096)
    assert p.kv_bytes_per_token == 2 * 32 * 4 * 128 * 2
    # A batch-1 step reads 2 of the 8 experts; 256 sequences read all of them (but for a
    # chance of (3/4)^256) and each sequence's KV at the mean context.
    experts = 32 * 8 * 3 * 4096 * 7168 * 2
    assert p.weight_bytes_per_step == p.weight_bytes - 2 * 16000 * 4096 - experts * 3 // 4
    context = p.running_sequences * (1024 + 256 // 2) * p.kv_bytes_per_token
    assert p.decode_step_floor_s == pytest.approx(
        (p.weight_bytes - 2 * 16000 * 4096 + context) / KNOWN_GPUS["h200"].bandwidth, rel=1e-6)


def test_what_would_fit(llama70b):
    # 32 sequences of 4,096 tokens hold 32 x 1.34 GB = 42.9 GB of KV; 90% of an H100 is 77 GB.
    # int4 weights (~38 GB) and two ranks (70.6 GB of weights each + 21.5 GB of KV) fall
    # short; four ranks hold 35.3 GB of weights and 10.7 GB of KV each.
    device, options = KNOWN_GPUS["h100-80gb"], PlanOptions(input_len=4000, output_len=96, concurrency=32)
    current = plan(llama70b, "70b", device, options)
    assert current.concurrent_sequences == 0 and not current.fits
    flags = [f for f, _ in suggestions(llama70b, "70b", device, options, current)]
    assert flags == ["--tensor-parallel-size 4", "--tensor-parallel-size 8"]


def test_shorter_context_suggested():
    config = model_shape(None, "smollm2-135m", None)[0]
    # 30 layers x 3 KV heads x 64 x 2 x 4 bytes (fp32) x 16 tokens = 737,280 bytes a block.
    options = PlanOptions(kv_cache_memory=10 * 737_280, input_len=200, output_len=100)
    current = plan(config, "smollm2", CPU, options)
    assert current.num_blocks == 10 and current.concurrent_sequences == 0 and not current.fits
    flags = [f for f, _ in suggestions(config, "smollm2", CPU, options, current)]
    assert "--max-model-len 160 (prompts up to 60 tokens)" in flags
    # Two sequences at once: five blocks (80 tokens) each.
    options = PlanOptions(kv_cache_memory=10 * 737_280, input_len=200, output_len=50, concurrency=2)
    current = plan(config, "smollm2", CPU, options)
    flags = [f for f, _ in suggestions(config, "smollm2", CPU, options, current)]
    assert "--max-model-len 80 (prompts up to 30 tokens)" in flags


def test_default_model_blocks_equal_the_engine(capsys):
    from kvserve.llm import LLM

    # fp32 on CPU: 64 MiB // 737,280 bytes a block = 91 blocks.
    config, name = model_shape(None, None, None)
    assert plan(config, name, CPU, PlanOptions(kv_cache_memory=64 * 2**20)).num_blocks == 91
    llm = LLM(kv_cache_memory="64MiB", max_model_len=1024)
    assert llm.engine.core.runner.num_blocks == 91


@pytest.mark.slow  # 2 GB of random fp32 weights
def test_dummy_qwen_blocks_equal_the_engine():
    from kvserve.llm import LLM

    # 24 layers x 2 KV heads x 64 x 2 x 4 bytes x 16 = 393,216 bytes a block; 2 GiB of them.
    config, name = model_shape(None, "qwen2.5-0.5b", None)
    assert plan(config, name, CPU, PlanOptions()).num_blocks == 2 * 2**30 // 393_216 == 5461
    llm = LLM(load_format="dummy", model_shape="qwen2.5-0.5b", skip_tokenizer_init=True)
    assert llm.engine.core.runner.num_blocks == 5461


def test_cli_json(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA_70B))
    assert main(["plan", "--hf-config", str(path), "--device", "h200", "-tp", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["fits"] and result["kv_bytes_per_token"] == 2 * 80 * 4 * 128 * 2


@pytest.mark.parametrize("flags, expected", [
    (["--device", "tpu-v9"], "known: h100-80gb, h200, a100-80gb, l40s, l4, cpu:GiB, auto"),
    (["--model-shape", "llama9"], "known: llama3-8b, mixtral-8x7b, qwen2.5-0.5b, qwen2.5-vl-7b, qwen3-30b-a3b, smollm2-135m"),
])
def test_unknown_names_list_the_known(flags, expected, capsys):
    assert main(["plan", *flags]) == 2
    assert expected in capsys.readouterr().err


def test_config_missing_fields_names_them(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({k: v for k, v in LLAMA_70B.items() if k not in ("hidden_size", "vocab_size")}))
    assert main(["plan", "--hf-config", str(path), "--device", "h200"]) == 2
    assert "missing required keys vocab_size, hidden_size" in capsys.readouterr().err


def test_sharegpt_workload_is_the_mean_of_its_conversations(tmp_path, capsys):
    from kvserve.model_executor.default_model import default_model_path
    from kvserve.model_executor.loader import load_tokenizer

    texts = [("Tell me about the sea and its tides.", "The sea rises and falls twice a day with the moon."),
             ("What is a paged KV cache in an inference engine?", "Fixed-size blocks of keys and values.")]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]} for q, a in texts
    ] + [{"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]}]))
    tokenizer = load_tokenizer(default_model_path())

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    # The third conversation is under the 4-token minimum bench serve's sampling drops.
    assert main(["plan", "--dataset", str(path), "--num-prompts", "2", "--device", "h200", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["input_len"] == -(-sum(count(q) for q, _ in texts) // 2)
    assert result["output_len"] == -(-sum(count(a) for _, a in texts) // 2)
