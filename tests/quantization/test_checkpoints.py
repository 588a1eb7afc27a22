"""Pre-quantized checkpoints detected from config.json, each written by the real tool:

* GPTQ (AutoGPTQ 0.7.1's QuantLinear.pack) and AWQ (AutoAWQ 0.2.9's WQLinear_GEMM):
  committed fixtures from tests/fixtures/quantized/make_fixtures.py, with the tools' own
  dequantization of every layer and greedy tokens of transformers running it;
* compressed-tensors pack-quantized (W4A16 / W8A16): written here with the
  compressed-tensors package (a test dependency), transformers' compressed-tensors
  integration decompressing it as the reference.

kvserve's weights must equal the tool's dequantization, and greedy output the tool's run.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from kvserve import LLM, SamplingParams
from kvserve.model_executor.errors import ModelLoadError
from kvserve.model_executor.layers.linear import Linear
from kvserve.model_executor.loader import LoadedModel, load_model
from kvserve.quantization import QuantizedLinear
from kvserve.quantization.fp8 import Fp8Linear
from kvserve.quantization.int4 import Int4Linear
from kvserve.quantization.int8 import GroupInt8Linear

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "quantized")
TOOL_FIXTURES = {
    "gptq-w4-g32": Int4Linear,
    "gptq-w4-g32-actorder-sym": Linear,  # act-order: exact fp32 weights in the model's own dense linears
    "gptq-w8-channel-sym": GroupInt8Linear,
    "awq-w4-g32": Int4Linear,
}


def layer_weights(loaded: LoadedModel) -> dict[str, torch.Tensor]:
    """Hugging Face linear name -> the weight kvserve computes with (fused layers split)."""
    weights = {}
    for name, module in loaded.model.named_modules():
        if name.endswith("lm_head") or not isinstance(module, (QuantizedLinear, nn.Linear)):
            continue
        weight = module.dequantize() if isinstance(module, QuantizedLinear) else module.weight.detach()
        shards = loaded.model.hf_shard_names(name)
        sizes = loaded.model.shard_sizes(name)
        weights.update(zip(shards, weight.split(sizes)))
    return weights


def greedy_with_top5(loaded: LoadedModel, prompts: list[list[int]], max_tokens: int):
    llm = LLM(loaded=loaded, kv_cache_memory="16MiB", enable_prefix_caching=False, max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [(list(o.outputs[0].token_ids), [set(step) for step in o.outputs[0].logprobs]) for o in outputs]


def assert_greedy_agrees(ours, reference_greedy: list[list[int]], reference_top5: list[list[list[int]]]) -> int:
    """DESIGN.md's two levels: identical tokens, or at the first difference each side's
    choice is in the other's top 5. Returns how many sequences were identical."""
    identical = 0
    for (tokens, top5), ref_tokens, ref_top5 in zip(ours, reference_greedy, reference_top5):
        if tokens == ref_tokens:
            identical += 1
            continue
        i = next(i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b)
        assert tokens[i] in ref_top5[i] and ref_tokens[i] in top5[i], (i, tokens, ref_tokens)
    return identical


@pytest.mark.parametrize("name", sorted(TOOL_FIXTURES))
def test_tool_written_checkpoint_matches_the_tool(name):
    directory = os.path.join(FIXTURES, name)
    loaded = load_model(directory)
    assert loaded.quantization == name.split("-")[0]
    kinds = {type(m) for n, m in loaded.model.named_modules() if "layers.0." in n and isinstance(m, nn.Module)
             and isinstance(m, (QuantizedLinear, nn.Linear))}
    assert kinds == {TOOL_FIXTURES[name]}
    reference = load_file(os.path.join(directory, "reference.safetensors"))  # the tool's fp16 output
    ours = layer_weights(loaded)
    assert set(ours) == set(reference)
    for layer, weight in ours.items():
        # The tools multiply in fp16 (one rounding); ours is the exact product in fp32.
        assert torch.equal(weight.half(), reference[layer]), layer
    with open(os.path.join(directory, "reference.json")) as f:
        expected = json.load(f)
    ours_greedy = greedy_with_top5(loaded, expected["prompts"], len(expected["greedy"][0]))
    identical = assert_greedy_agrees(ours_greedy, expected["greedy"], expected["top5"])
    print(f"{name}: {identical} of {len(expected['greedy'])} greedy sequences identical")
    assert identical >= len(expected["greedy"]) - 1


# --- compressed-tensors, written at test time ------------------------------------------

def write_compressed_tensors(model, directory: str, bits: int, symmetric: bool, group_size: int | None) -> None:
    """Quantize `model` (a transformers model) with compressed-tensors' own qparams and
    save it in its pack-quantized format, as llmcompressor's save_pretrained does."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric,
                            strategy="group" if group_size else "channel", group_size=group_size)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
                                ignore=["lm_head"], format="pack-quantized")
    compress_and_save(model, config, args, directory,
                      lambda w: w.reshape(w.shape[0], -1, group_size or w.shape[1]))


def compress_and_save(model, config, weight_args, directory: str, grouped: Callable) -> None:
    """Quantize `model` by `config` with min/max quantization parameters over the groups
    `grouped(weight)` lays out in its last dimension, and save it compressed as
    llmcompressor's save_pretrained does."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import apply_quantization_config
    from compressed_tensors.quantization.utils import calculate_qparams

    apply_quantization_config(model, config, show_progress=False)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "quantization_scheme"):
                groups = grouped(module.weight)
                scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), weight_args)
                module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
                module.weight_zero_point.copy_(zero_point.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor(quantization_config=config)
    compressor.compress_model(model)
    model.save_pretrained(directory)
    compressor.update_config(directory)


def decompressed_reference(directory: str):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    return AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, quantization_config=CompressedTensorsConfig(run_compressed=False)
    )


def transformers_greedy(model, prompts: list[list[int]], max_tokens: int):
    greedy, top5 = [], []
    with torch.no_grad():
        for prompt in prompts:
            # No EOS: min_new_tokens would mask its logit, which kvserve's ignore_eos does not.
            out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, eos_token_id=None,
                                 do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0)
            greedy.append(out.sequences[0, len(prompt):].tolist())
            top5.append([scores[0].topk(5).indices.tolist() for scores in out.scores])
    return greedy, top5


@pytest.mark.parametrize(
    "bits, symmetric, group_size, kind",
    [(4, False, 32, Int4Linear), (4, True, 32, Int4Linear), (8, True, None, GroupInt8Linear),
     (8, False, 32, GroupInt8Linear), (8, False, None, GroupInt8Linear)],
)
def test_compressed_tensors_checkpoint_matches_the_package(save_hf_model, bits, symmetric, group_size, kind):
    pytest.importorskip("compressed_tensors")
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = save_hf_model(LlamaForCausalLM(LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)))
    # The float model (randomized, with a tokenizer) is re-saved compressed in place.
    write_compressed_tensors(LlamaForCausalLM.from_pretrained(directory), directory, bits, symmetric, group_size)
    loaded = load_model(directory)
    assert loaded.quantization == "compressed-tensors"
    assert isinstance(loaded.model.model.layers[1].mlp.down_proj, kind)
    reference = decompressed_reference(directory)
    reference_state = reference.state_dict()
    for layer, weight in layer_weights(loaded).items():
        # fp32 scales: the package's (q - z) * s is one rounding; the int4/int8 layers'
        # q * s + (-z * s) may differ from it in the last bits of the layer's range.
        expected = reference_state[f"{layer}.weight"]
        torch.testing.assert_close(weight, expected, rtol=0, atol=2**-21 * expected.abs().max().item())
    prompts = [[1, 5, 9], [3, 7, 11, 13, 17], [2, 4, 8, 16, 32, 64, 127]]
    greedy, top5 = transformers_greedy(reference, prompts, 8)
    identical = assert_greedy_agrees(greedy_with_top5(loaded, prompts, 8), greedy, top5)
    assert identical >= len(prompts) - 1


# --- bad configs ----------------------------------------------------------------------

def _with_config(tmp_path, fixture: str, **changes) -> str:
    directory = str(tmp_path / fixture)
    shutil.copytree(os.path.join(FIXTURES, fixture), directory)
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["quantization_config"].update(changes)
    with open(path, "w") as f:
        json.dump(config, f)
    return directory


@pytest.mark.parametrize(
    "fixture, changes, message",
    [
        ("gptq-w4-g32", {"bits": 3}, r"quant_method='gptq' has bits=3, which is not supported; supported: 4, 8"),
        ("gptq-w4-g32", {"lm_head": True}, r"has lm_head=True, which is not supported"),
        ("gptq-w4-g32", {"checkpoint_format": "marlin"},
         r"checkpoint_format='marlin', which is not supported; supported: gptq, gptq_v2"),
        ("awq-w4-g32", {"version": "gemv"}, r"quant_method='awq' has version='gemv', which is not supported; "
                                            r"supported: gemm"),
        ("awq-w4-g32", {"quant_method": "bitsandbytes"},
         r"quant_method='bitsandbytes' is not supported; supported: gptq, awq, compressed-tensors"),
        ("awq-w4-g32", {"quant_method": "compressed-tensors", "format": "int-quantized",
                        "config_groups": {"group_0": {"weights": {"type": "int", "num_bits": 8}}}},
         r"config_groups.group_0.format='int-quantized', which is not supported; supported: pack-quantized, "
         r"float-quantized"),
        ("awq-w4-g32", {"quant_method": "compressed-tensors", "format": "float-quantized",
                        "config_groups": {"group_0": {"weights": {"type": "float", "num_bits": 8, "strategy": "group"}}}},
         r"config_groups.group_0.weights.strategy='group', which is not supported; supported: channel, tensor, block"),
        ("awq-w4-g32", {"quant_method": "fp8", "weight_block_size": None},
         r"quant_method='fp8' has weight_block_size=None, which is not supported"),
    ],
)
def test_unsupported_quantization_config_fails_at_load(tmp_path, fixture, changes, message):
    with pytest.raises(ModelLoadError, match=message) as error:
        load_model(_with_config(tmp_path, fixture, **changes))
    assert f"{fixture}/config.json: quantization_config quant_method=" in str(error.value)


def test_quantizing_a_quantized_checkpoint_again_is_refused():
    with pytest.raises(ModelLoadError, match=r"already quantized \(gptq\); quantization='int4' applies to "
                                             "float checkpoints only"):
        load_model(os.path.join(FIXTURES, "gptq-w4-g32"), quantization="int4")


def test_compressed_tensors_smollm2(smollm2_hf, smollm2_loaded, tmp_path):
    """The real SmolLM2 written as W4A16 (group 32, asymmetric) by compressed-tensors."""
    pytest.importorskip("compressed_tensors")
    import copy

    from transformers import LlamaForCausalLM

    # A plain float copy: transformers refuses to save a model it loaded from GGUF.
    config = copy.deepcopy(smollm2_hf.config)
    config.__dict__.pop("quantization_config", None)
    model = LlamaForCausalLM(config)
    model.load_state_dict(smollm2_hf.state_dict())
    directory = str(tmp_path / "smollm2-w4a16")
    write_compressed_tensors(model, directory, 4, False, 32)
    smollm2_loaded.tokenizer.save_pretrained(directory)
    loaded = load_model(directory)
    packed = [m for m in loaded.model.modules() if isinstance(m, QuantizedLinear)]
    assert len(packed) == 120 and all(isinstance(m, Int4Linear) and m.cpu_kernel for m in packed)
    reference = decompressed_reference(directory)
    reference_state = reference.state_dict()
    for layer, weight in layer_weights(loaded).items():
        expected = reference_state[f"{layer}.weight"]
        torch.testing.assert_close(weight, expected, rtol=0, atol=2**-21 * expected.abs().max().item())
    prompts = [smollm2_loaded.tokenizer(p).input_ids for p in
               ("The capital of France is", "def fibonacci(n):", "Write a haiku about autumn leaves.")]
    greedy, top5 = transformers_greedy(reference, prompts, 8)
    identical = assert_greedy_agrees(greedy_with_top5(loaded, prompts, 8), greedy, top5)
    print(f"SmolLM2 W4A16: {identical} of {len(prompts)} greedy sequences identical to transformers")
    assert identical >= len(prompts) - 1


# --- fp8 checkpoints ------------------------------------------------------------------

def write_compressed_tensors_fp8(model, directory: str, strategy: str) -> None:
    """Quantize `model` to fp8 weights with compressed-tensors' own qparams, dynamic per-token
    fp8 activations (llmcompressor's FP8_DYNAMIC scheme for "channel"), and save it in its
    float-quantized format."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    weights = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy=strategy)
    activations = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=activations)
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"], format="float-quantized")
    compress_and_save(model, config, weights, directory,
                      lambda w: w if strategy == "channel" else w.reshape(1, -1))


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_compressed_tensors_fp8_checkpoint_matches_the_package(save_hf_model, strategy):
    pytest.importorskip("compressed_tensors")
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = save_hf_model(LlamaForCausalLM(LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)))
    write_compressed_tensors_fp8(LlamaForCausalLM.from_pretrained(directory), directory, strategy)
    loaded = load_model(directory)
    assert loaded.quantization == "compressed-tensors"
    assert isinstance(loaded.model.model.layers[1].mlp.down_proj, Fp8Linear)
    reference_state = decompressed_reference(directory).state_dict()
    for layer, weight in layer_weights(loaded).items():
        # One rounding each side: e4m3 value times an fp32 scale.
        torch.testing.assert_close(weight, reference_state[f"{layer}.weight"], rtol=0, atol=0)
    prompts = [[1, 5, 9], [3, 7, 11, 13, 17], [2, 4, 8, 16, 32, 64, 127]]
    greedy, top5 = transformers_greedy(decompressed_reference(directory), prompts, 8)
    identical = assert_greedy_agrees(greedy_with_top5(loaded, prompts, 8), greedy, top5)
    assert identical >= len(prompts) - 1


def test_hf_fp8_block_checkpoint(save_hf_model):
    """quant_method "fp8" with [128, 128] blocks (transformers' FineGrainedFP8 layout),
    written here from e4m3 values and block scales chosen at random: the loaded weights
    are value * block scale, blocks cut short at the matrix edges (N = 320, K = 192)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = save_hf_model(LlamaForCausalLM(LlamaConfig(
        vocab_size=128, hidden_size=192, intermediate_size=320, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)))
    tensors = load_file(os.path.join(directory, "model.safetensors"))
    generator = torch.Generator().manual_seed(0)
    expected = {}
    for name in [n for n in tensors if n.endswith("proj.weight")]:
        n, k = tensors[name].shape
        q = (torch.randn(n, k, generator=generator) * 50).to(torch.float8_e4m3fn)
        scale = torch.rand(-(-n // 128), -(-k // 128), generator=generator) / 100
        full_scale = scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
        expected[name.removesuffix(".weight")] = q.float() * full_scale
        tensors[name], tensors[name + "_scale_inv"] = q, scale
    save_file(tensors, os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    loaded = load_model(directory)
    assert loaded.quantization == "fp8"
    weights = layer_weights(loaded)
    assert weights.keys() == expected.keys()
    for layer, weight in weights.items():
        torch.testing.assert_close(weight, expected[layer], rtol=0, atol=0)
