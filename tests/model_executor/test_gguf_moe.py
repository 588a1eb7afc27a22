"""Mixture-of-experts GGUF files as llama.cpp lays them out (each layer's experts stacked in
one [E, N, K] tensor a projection, the router as ffn_gate_inp, Qwen2-MoE's shared expert as
*_shexp; older Mixtral files one tensor an expert), written here from tiny random
transformers models with gguf-py's own Hugging Face -> GGUF name map, and Q and K permuted
for "llama" files as llama.cpp's converter does: kvserve's logits and greedy tokens against
the transformers model they came from. transformers' own GGUF reader reads the qwen files
back to that model (so they are what llama.cpp expects), and is the reference for experts
stored as Q8_0 blocks."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from kvserve.model_executor.loader import load_model
from tests.conftest import randomize

gguf = pytest.importorskip("gguf")

VOCAB = 256
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
# (transformers model, llama.cpp architecture)
MODELS = {
    # Renormalised top-k, q/k norms, a head wider than hidden / heads.
    "qwen3-moe": (lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(
        **SMALL, head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True)),
        "qwen3moe"),
    # A shared expert with its sigmoid gate, top-k not renormalised, q/k/v biases.
    "qwen2-moe-shared-expert": (lambda: Qwen2MoeForCausalLM(Qwen2MoeConfig(
        **SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=96,
        norm_topk_prob=False)), "qwen2moe"),
    # llama.cpp's "llama" with experts: Q and K rows permuted, the experts w1/w3/w2.
    "mixtral": (lambda: MixtralForCausalLM(MixtralConfig(
        **SMALL, num_local_experts=4, num_experts_per_tok=2, sliding_window=None)), "llama"),
}
# Mixtral's expert linears under llama.cpp's merged names (gguf-py maps those).
EXPERT_LINEARS = {"llama": ("w1", "w3", "w2"), "qwen2moe": ("gate_proj", "up_proj", "down_proj"),
                  "qwen3moe": ("gate_proj", "up_proj", "down_proj")}


def permute_for_llama_cpp(weight: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute: each head's rotate_half halves interleaved."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def write_gguf(hf_model, directory: str, arch: str, expert_type: str = "F32", stacked: bool = True) -> str:
    """hf_model's weights as a GGUF file of llama.cpp's `arch` in `directory`: experts stacked
    (or, not `stacked`, one tensor each as older Mixtral files), stored as `expert_type`
    (F32 or Q8_0 blocks); returns the file's path."""
    from safetensors.torch import load_file

    config = hf_model.config
    hf_dir = os.path.join(directory, "hf")
    hf_model.save_pretrained(hf_dir)
    saved = load_file(os.path.join(hf_dir, "model.safetensors"))
    weights = {name: tensor.float().numpy() for name, tensor in saved.items()}
    model_arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    names = gguf.get_tensor_name_map(model_arch, config.num_hidden_layers)
    path = os.path.join(directory, f"{arch}.gguf")
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_expert_count(getattr(config, "num_local_experts", None) or config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if arch != "llama":
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if getattr(config, "shared_expert_intermediate_size", 0):
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    moe = "block_sparse_moe" if arch == "llama" else "mlp"
    experts = getattr(config, "num_local_experts", None) or config.num_experts
    for layer in range(config.num_hidden_layers):
        for index, linear in enumerate(EXPERT_LINEARS[arch]):
            per_expert = [weights.pop(f"model.layers.{layer}.{moe}.experts.{e}.{linear}.weight")
                          for e in range(experts)]
            if stacked:
                name = names.get_name(f"model.layers.{layer}.{moe}.experts.{linear}.weight", try_suffixes=(".weight",))
                _add(writer, name, np.stack(per_expert), expert_type)
            else:
                for expert, weight in enumerate(per_expert):
                    _add(writer, f"blk.{layer}.{('ffn_gate', 'ffn_up', 'ffn_down')[index]}.{expert}.weight", weight,
                         expert_type)
    for name, weight in weights.items():
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            weight = permute_for_llama_cpp(weight, heads)
        if name.endswith("shared_expert_gate.weight"):
            weight = weight.reshape(-1)  # llama.cpp's gate is a vector
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), weight)
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    return path


def _add(writer, name: str, weight: np.ndarray, expert_type: str) -> None:
    if expert_type == "F32":
        writer.add_tensor(name, weight)
    else:
        quant = gguf.GGMLQuantizationType[expert_type]
        writer.add_tensor(name, gguf.quants.quantize(weight, quant), raw_dtype=quant)


def qwen3_moe_file(directory: str, expert_type: str, seed: int):
    """A random tiny Qwen3-MoE, its GGUF file with experts as `expert_type` blocks, and
    transformers' model read back from that file (the blocks' values)."""
    make, arch = MODELS["qwen3-moe"]
    hf_model = make().eval()
    randomize(hf_model, seed)
    path = write_gguf(hf_model, directory, arch, expert_type=expert_type)
    reread = AutoModelForCausalLM.from_pretrained(directory, gguf_file=os.path.basename(path),
                                                  config=hf_model.config).eval()
    return hf_model, path, reread


def greedy_and_logits(model, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation of prompt and the logits of prompt + it."""
    with torch.no_grad():
        generated = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=steps,
                                   min_new_tokens=steps, pad_token_id=0)[0, len(prompt):].tolist()
        return generated, model(torch.tensor([prompt + generated])).logits[0].float()


def ours(loaded, paged_runner, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """kvserve's greedy continuation of prompt and the logits of prompt + it: a prefill,
    then decodes."""
    runner = paged_runner(loaded.model, loaded.config)
    logits = [runner.step([(0, prompt)])[0]]
    tokens: list[int] = []
    for _ in range(steps):
        tokens.append(int(logits[-1][-1].argmax()))
        logits.append(runner.step([(0, [tokens[-1]])])[0])
    return tokens, torch.cat(logits)[:-1]


PROMPT = [5, 9, 200, 17, 3, 44, 90, 121, 7]


# Every model stacked; older Mixtral files one tensor an expert.
LAYOUTS = [(model, "stacked") for model in sorted(MODELS)] + [("mixtral", "one-tensor-an-expert")]


@pytest.mark.parametrize(("model", "layout"), LAYOUTS, ids=[f"{model}-{layout}" for model, layout in LAYOUTS])
def test_mixture_gguf_matches_the_transformers_model_it_came_from(model, layout, tmp_path, paged_runner) -> None:
    make, arch = MODELS[model]
    hf_model = make().eval()
    randomize(hf_model, 0)
    path = write_gguf(hf_model, str(tmp_path), arch, stacked=layout == "stacked")
    expected_tokens, expected = greedy_and_logits(hf_model, PROMPT, 12)
    if arch != "llama":  # transformers reads llama.cpp's qwen mixtures (not Mixtral's "llama")
        reread = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=os.path.basename(path),
                                                      config=hf_model.config).eval()
        torch.testing.assert_close(greedy_and_logits(reread, PROMPT, 12)[1], expected, atol=0, rtol=0)
    tokens, logits = ours(load_model(path, skip_tokenizer_init=True), paged_runner, PROMPT, 12)
    assert tokens == expected_tokens
    torch.testing.assert_close(logits, expected[:-1], atol=1e-4, rtol=0)


def test_q8_0_experts_dequantize_as_transformers_reads_them(tmp_path, paged_runner) -> None:
    """Experts stored as Q8_0 blocks: kvserve's logits against transformers' GGUF reader on
    the same file (both from the blocks' values)."""
    hf_model, path, reread = qwen3_moe_file(str(tmp_path), "Q8_0", seed=1)
    expected_tokens, expected = greedy_and_logits(reread, PROMPT, 12)
    # The blocks moved the weights: the file is not the float model.
    assert not torch.allclose(expected, greedy_and_logits(hf_model, PROMPT, 12)[1], atol=1e-4)
    tokens, logits = ours(load_model(path, skip_tokenizer_init=True), paged_runner, PROMPT, 12)
    assert tokens == expected_tokens
    torch.testing.assert_close(logits, expected[:-1], atol=1e-4, rtol=0)


def test_mixture_config_from_the_file(tmp_path) -> None:
    make, arch = MODELS["qwen2-moe-shared-expert"]
    hf_model = make()
    loaded = load_model(write_gguf(hf_model, str(tmp_path), arch), skip_tokenizer_init=True)
    config = loaded.config
    assert (config.architecture, config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
            config.shared_expert_intermediate_size, config.norm_topk_prob, config.dense_mlp_layers) == (
        "Qwen2MoeForCausalLM", 4, 2, 64, 96, False, ())


def test_the_engine_serves_a_mixture_gguf_as_each_quantization_loads_it(tmp_path) -> None:
    """LLM(model=file) as a user runs it, its Q8_0 experts dequantized (quantization None),
    run from their blocks (gguf) or as the CPU plan takes them (auto): the greedy tokens of
    transformers' reader of the file."""
    from kvserve import LLM, SamplingParams

    _, path, reread = qwen3_moe_file(str(tmp_path), "Q8_0", seed=2)
    expected, _ = greedy_and_logits(reread, PROMPT, 8)
    for quantization in (None, "gguf", "auto"):
        llm = LLM(model=path, quantization=quantization, skip_tokenizer_init=True, kv_cache_memory="64MiB",
                  max_model_len=256)
        output = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=8))
        assert output[0].outputs[0].token_ids == expected, quantization


@pytest.mark.parametrize("expert_type", ["Q8_0", "Q4_0"])
def test_packed_experts_are_their_rows_of_the_files_blocks(expert_type, tmp_path, paged_runner) -> None:
    """quantization='gguf': each expert a layer built from its rows of the stacked blocks (the
    stacked tensor never dequantized whole), equal to gguf-py's dequantization of those rows,
    and the model's greedy tokens those of transformers' reader of the file."""
    from kvserve.quantization.base import QuantizedLinear

    _, path, reread = qwen3_moe_file(str(tmp_path), expert_type, seed=3)
    loaded = load_model(path, quantization="gguf", skip_tokenizer_init=True)
    stacked = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.1.ffn_down_exps.weight")
    expected = torch.from_numpy(np.array(gguf.quants.dequantize(stacked.data, stacked.tensor_type)))
    for expert in range(4):
        layer = loaded.model.model.layers[1].mlp.experts[expert].down_proj
        assert isinstance(layer, QuantizedLinear)
        torch.testing.assert_close(layer.dequantize(torch.float32), expected[expert], atol=1e-6, rtol=0)
    expected_tokens, expected = greedy_and_logits(reread, PROMPT, 12)
    tokens, logits = ours(loaded, paged_runner, PROMPT, 12)
    assert tokens == expected_tokens
    torch.testing.assert_close(logits, expected[:-1], atol=1e-3, rtol=0)
