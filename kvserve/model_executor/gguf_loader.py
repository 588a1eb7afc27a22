"""Config and weights from a llama.cpp GGUF file: dequantized to the run dtype, or with
the linear layers' blocks kept packed (quantization='gguf'). Mixtures of experts (Mixtral as
llama.cpp's "llama" with experts, "qwen2moe", "qwen3moe") store each layer's experts stacked
in one tensor a projection ([E, N, K]): dequantized one expert at a time, or with
quantization='gguf' each expert's rows of blocks kept packed."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize
from torch import nn
from tqdm import tqdm

from kvserve.config import ModelConfig
from kvserve.model_executor.errors import ModelLoadError
from kvserve.model_executor.models.llama import LlamaForCausalLM
from kvserve.quantization.gguf import FLOAT_TYPES, SUPPORTED_TYPES, unpack_blocks
from kvserve.quantization.grid import grid_linear

# GGUF general.architecture -> our architecture name.
_GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}
# llama.cpp's "llama" with experts is Mixtral.
_MIXTURE_OF_LLAMA = "MixtralForCausalLM"
# Whether a token's top-k routing weights are scaled to sum to one, where the file does not
# say ({arch}.expert_weights_norm): what llama.cpp's graph for the architecture does, as the
# models' own configs (Mixtral and Qwen3-MoE renormalise, Qwen2-MoE does not).
_RENORMALIZES_BY_DEFAULT = {"llama": True, "qwen2moe": False, "qwen3moe": True}
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # A mixture's router and Qwen2-MoE's shared expert with its gate (`mlp` is Mixtral's
    # `block_sparse_moe`: _moe_name).
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# A layer's experts stacked [E, N, K] -> each expert's linear (Mixtral's names: _EXPERT_NAMES).
_STACKED_EXPERT_TENSORS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
# Older Mixtral files store each expert apart: blk.N.ffn_gate.E.weight.
_EXPERT_TENSOR_RE = re.compile(r"blk\.(\d+)\.(ffn_gate|ffn_up|ffn_down)\.(\d+)\.weight")
_EXPERT_NAMES = {_MIXTURE_OF_LLAMA: {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}}
_LAYER_TENSOR_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# llama.cpp's own llama3 RoPE frequency divisors, not a weight.
_ROPE_FREQS = "rope_freqs.weight"


class _ScalarFieldsReader(GGUFReader):
    """gguf-py's reader without the array values: it builds two numpy views for every string
    of an array (SmolLM2's vocabulary and merges, ~98k strings: 3.7 s of a 2-core machine's
    load), and kvserve reads scalar fields and tensors only (tokenizers come from
    transformers' own conversion of the file). Arrays are stepped over and their fields
    dropped, so reading one gives the field's absence, never empty contents."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.fields = {name: field for name, field in self.fields.items() if field.types[0] != GGUFValueType.ARRAY}

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list, list[int], list[GGUFValueType]]:
        if GGUFValueType(raw_type) != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        item_type = GGUFValueType(int(self._get(orig_offs, np.uint32)[0]))
        length = int(self._get(orig_offs + 4, np.uint64)[0])
        offs = orig_offs + 12
        if item_type == GGUFValueType.STRING:
            raw = memoryview(self.data)  # each string: a little-endian uint64 length, then its bytes
            for _ in range(length):
                offs += 8 + int.from_bytes(raw[offs:offs + 8], "little")
        elif item_type in self.gguf_scalar_to_np:
            offs += length * np.dtype(self.gguf_scalar_to_np[item_type]).itemsize
        else:  # arrays of arrays: gguf-py's own walk
            return super()._get_field_parts(orig_offs, raw_type)
        return offs - orig_offs, [], [], [GGUFValueType.ARRAY, item_type]


def open_gguf(path: str) -> GGUFReader:
    try:
        return _ScalarFieldsReader(path)
    except Exception as e:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_model_config(reader: GGUFReader, path: str, dtype: torch.dtype) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in _GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: unsupported GGUF architecture {arch!r}; "
            f"supported: {', '.join(sorted(_GGUF_ARCHITECTURES))}"
        )
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{path}: no token_embd.weight tensor")

    def required(key: str) -> Any:
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"{path}: missing GGUF metadata key {arch}.{key}")
        return value

    num_layers = int(required("block_count"))
    mixture = _mixture_fields(reader, path, arch, tensors, num_layers)
    if arch.endswith("moe") and not mixture:
        raise ModelLoadError(f"{path}: a {arch} file without {arch}.expert_count")
    intermediate_size = _field(reader, f"{arch}.feed_forward_length")
    if intermediate_size is None and not mixture:
        required("feed_forward_length")
    hidden_size = int(required("embedding_length"))
    num_heads = int(required("attention.head_count"))
    rope_scaling: dict[str, Any] | None = None
    if _field(reader, f"{arch}.rope.scaling.type") == "linear":
        rope_scaling = {"rope_type": "linear",
                        "factor": float(_field(reader, f"{arch}.rope.scaling.factor"))}
    if _ROPE_FREQS in tensors:
        factors = dequantize(tensors[_ROPE_FREQS].data, tensors[_ROPE_FREQS].tensor_type)
        rope_scaling = {"rope_type": "freq_factors", "freq_factors": factors.tolist()}
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture=_MIXTURE_OF_LLAMA if arch == "llama" and mixture else _GGUF_ARCHITECTURES[arch],
        # ne[1] of the embedding (GGUF lists dims innermost first).
        vocab_size=int(tensors["token_embd.weight"].shape[1]),
        hidden_size=hidden_size,
        # A mixture's dense layers' width (none: the experts').
        intermediate_size=int(intermediate_size if intermediate_size is not None else mixture["moe_intermediate_size"]),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=int(_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=int(_field(reader, f"{arch}.attention.key_length", hidden_size // num_heads)),
        rms_norm_eps=float(required("attention.layer_norm_rms_epsilon")),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=[] if eos is None else [int(eos)],
        dtype=dtype,
        **mixture,
    )


def _mixture_fields(reader: GGUFReader, path: str, arch: str, tensors: dict[str, Any],
                    num_layers: int) -> dict[str, Any]:
    """ModelConfig's mixture-of-experts fields of the file ({} for a dense model): the counts
    from its metadata, the widths from its expert tensors (stacked [E, N, K] or, in older
    Mixtral files, one tensor an expert), its dense layers those without a router."""
    experts = int(_field(reader, f"{arch}.expert_count", 0) or 0)
    if not experts:
        return {}
    used = _field(reader, f"{arch}.expert_used_count")
    if used is None:
        raise ModelLoadError(f"{path}: missing GGUF metadata key {arch}.expert_used_count")
    gating = _field(reader, f"{arch}.expert_gating_func")
    if gating is not None and int(gating) != 1:  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
        raise ModelLoadError(f"{path}: expert gating function {gating} is not supported (a softmax only)")
    sparse = [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" in tensors]
    if not sparse:
        raise ModelLoadError(f"{path}: {experts} experts a layer, but no layer has a router (ffn_gate_inp)")
    first = sparse[0]
    gate = tensors.get(f"blk.{first}.ffn_gate_exps.weight", tensors.get(f"blk.{first}.ffn_gate.0.weight"))
    if gate is None:
        raise ModelLoadError(f"{path}: no expert tensors in layer {first} (blk.{first}.ffn_gate_exps)")
    shared = tensors.get(f"blk.{first}.ffn_gate_shexp.weight")
    renormalize = _field(reader, f"{arch}.expert_weights_norm")
    return {
        "num_experts": experts,
        "num_experts_per_tok": int(used),
        "moe_intermediate_size": int(gate.shape[1]),  # GGUF lists dims innermost first: [K, N, (E)]
        "norm_topk_prob": bool(renormalize) if renormalize is not None else _RENORMALIZES_BY_DEFAULT.get(arch, True),
        "shared_expert_intermediate_size": int(shared.shape[1]) if shared is not None else 0,
        "dense_mlp_layers": tuple(i for i in range(num_layers) if i not in sparse),
    }


def _hf_name(gguf_name: str, architecture: str) -> str:
    match = _LAYER_TENSOR_RE.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_TENSORS:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{_moe_name(_LAYER_TENSORS[part], architecture)}.{kind}"
    match = _EXPERT_TENSOR_RE.fullmatch(gguf_name)
    if match:
        layer, part, expert = match.groups()
        return _expert_name(int(layer), int(expert), _STACKED_EXPERT_TENSORS[f"{part}_exps"], architecture)
    base, _, kind = gguf_name.rpartition(".")
    return f"{_GLOBAL_TENSORS[base]}.{kind}" if base in _GLOBAL_TENSORS else gguf_name


def _moe_name(name: str, architecture: str) -> str:
    """A layer-relative Hugging Face name with Mixtral's `block_sparse_moe` for a mixture's
    `mlp`."""
    if architecture == _MIXTURE_OF_LLAMA and name.split(".")[0] == "mlp":
        return "block_sparse_moe" + name[len("mlp"):]
    return name


def _expert_name(layer: int, expert: int, projection: str, architecture: str) -> str:
    """The Hugging Face weight name of one expert's gate_proj, up_proj or down_proj."""
    projection = _EXPERT_NAMES.get(architecture, {}).get(projection, projection)
    return f"model.layers.{layer}.{_moe_name('mlp', architecture)}.experts.{expert}.{projection}.weight"


def _unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf's Q/K row permutation for llama (it reorders each head's
    rows from rotate_half halves into interleaved pairs); same as transformers'
    LlamaTensorProcessor._reverse_permute_weights."""
    half_dim = weight.shape[0] // num_heads // 2
    return (
        weight.reshape(num_heads, half_dim, 2, *weight.shape[1:])
        .transpose(1, 2)
        .reshape(weight.shape)
    )


def _rope_rows(gguf_name: str, config: ModelConfig, arch: str) -> int | None:
    """Head count whose RoPE row order convert_hf_to_gguf permuted in this tensor, if any."""
    if arch != "llama":
        return None
    if gguf_name.endswith(("attn_q.weight", "attn_q.bias")):
        return config.num_attention_heads
    if gguf_name.endswith(("attn_k.weight", "attn_k.bias")):
        return config.num_key_value_heads
    return None


def install_packed_linears(
    model: LlamaForCausalLM, reader: GGUFReader, path: str, config: ModelConfig, arch: str,
    device: torch.device | str,
) -> set[str]:
    """Replace each linear layer (LM head excepted) whose GGUF tensors are all quantized by
    a layer built from their blocks, in the layout that runs on `device` (grid_linear); return
    the GGUF names consumed. Layers stored as F32/F16/BF16 stay float. An unsupported block
    type fails before anything is built. A mixture's experts take their rows of the stacked
    expert tensors (consumed whole)."""
    sources = _packing_sources(reader, config.architecture)
    plans: list[tuple[str, nn.Linear, list[tuple[Any, int | None]]]] = []
    for module_name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or module_name.rsplit(".", 1)[-1] == "lm_head":
            continue
        shards = [sources.get(f"{hf}.weight") for hf in model.hf_shard_names(module_name)]
        if any(s is None for s in shards) or any(t.tensor_type in FLOAT_TYPES for t, _ in shards):
            continue  # missing tensors are reported by load_weights; float ones load as float
        for t, _ in shards:
            if t.tensor_type not in SUPPORTED_TYPES:
                raise ModelLoadError(
                    f"{path}: tensor {t.name} ({module_name}) has GGUF type {t.tensor_type.name}; "
                    f"quantization='gguf' supports {', '.join(q.name for q in SUPPORTED_TYPES)} "
                    "(quantization=None dequantizes any type)"
                )
        plans.append((module_name, module, shards))
    consumed: set[str] = set()
    for module_name, module, shards in tqdm(plans, desc="Repacking GGUF blocks", leave=False,
                                            disable=len(plans) < 64):
        parts = []
        for t, expert in shards:
            shape = (int(t.shape[1]), int(t.shape[0]))  # GGUF lists dims innermost first
            grid = unpack_blocks(t.data if expert is None else t.data[expert], t.tensor_type, shape, t.name)
            heads = _rope_rows(t.name, config, arch)
            if heads is not None:
                grid = grid.map_rows(lambda rows, h=heads: _unpermute_rope_rows(rows, h))
            parts.append(grid)
            consumed.add(t.name)
        parent_name, _, attr = module_name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, grid_linear(parts, module.bias, device))
    return consumed


def _packing_sources(reader: GGUFReader, architecture: str) -> dict[str, tuple[Any, int | None]]:
    """Hugging Face weight name -> (its GGUF tensor, the expert's index in a stacked expert
    tensor, or None for a tensor of its own)."""
    sources: dict[str, tuple[Any, int | None]] = {}
    for t in reader.tensors:
        stacked = _LAYER_TENSOR_RE.fullmatch(t.name)
        if stacked and stacked.group(2) in _STACKED_EXPERT_TENSORS:
            layer, projection = int(stacked.group(1)), _STACKED_EXPERT_TENSORS[stacked.group(2)]
            for expert in range(int(t.shape[2])):
                sources[_expert_name(layer, expert, projection, architecture)] = (t, expert)
        else:
            sources[_hf_name(t.name, architecture)] = (t, None)
    return sources


def iter_gguf_weights(
    reader: GGUFReader, path: str, config: ModelConfig, arch: str, skip: set[str] = frozenset()
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (Hugging Face name, fp32 CPU tensor) for every weight in the file not in skip; a
    stacked expert tensor one expert at a time (only that expert's fp32 copy at once)."""
    for tensor in tqdm(reader.tensors, desc=f"Loading {os.path.basename(path)}", unit="tensor",
                       disable=len(reader.tensors) < 64, leave=False):
        if tensor.name == _ROPE_FREQS or tensor.name in skip:
            continue
        stacked = _LAYER_TENSOR_RE.fullmatch(tensor.name)
        if stacked and stacked.group(2) in _STACKED_EXPERT_TENSORS:  # [E, N, K]
            layer, projection = int(stacked.group(1)), _STACKED_EXPERT_TENSORS[stacked.group(2)]
            for expert, rows in enumerate(tensor.data):
                name = _expert_name(layer, expert, projection, config.architecture)
                yield name, _dequantized(rows, tensor, path)
            continue
        weight = _dequantized(tensor.data, tensor, path)
        heads = _rope_rows(tensor.name, config, arch)
        if heads is not None:
            weight = _unpermute_rope_rows(weight, heads)
        name = _hf_name(tensor.name, config.architecture)
        if name.endswith("shared_expert_gate.weight"):
            weight = weight.reshape(1, -1)  # llama.cpp keeps this [1, H] gate as a vector
        yield name, weight


def _dequantized(data: np.ndarray, tensor: Any, path: str) -> torch.Tensor:
    """`data` (all or part of `tensor`'s rows, as stored) as an fp32 CPU tensor. The block
    types we pack unpack with torch, whole tensors at once: the same values as gguf-py's
    numpy dequantizer (exact grids), which works row group by row group and took ~40% of
    loading the embedded model."""
    try:
        if tensor.tensor_type in SUPPORTED_TYPES and data.ndim == 2:
            shape = (data.shape[0], int(tensor.shape[0]))  # GGUF lists the row length first
            return unpack_blocks(data, tensor.tensor_type, shape, tensor.name).dequantize()
        array = dequantize(data, tensor.tensor_type)
    except Exception as e:
        raise ModelLoadError(f"{path}: cannot dequantize tensor {tensor.name}: {e}") from e
    return torch.from_numpy(np.array(array, dtype=np.float32))


def gguf_architecture(reader: GGUFReader) -> str:
    return str(_field(reader, "general.architecture"))
