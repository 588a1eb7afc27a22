"""load_model: a Hugging Face directory (safetensors), a GGUF file, random weights in a
named shape, or the embedded default model."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from kvserve.config import ModelConfig
from kvserve.model_executor.default_model import default_model_path
from kvserve.model_executor.dummy import dummy_model_config, init_dummy_weights
from kvserve.model_executor.errors import ModelLoadError
from kvserve.model_executor.models.llama import LlamaForCausalLM
from kvserve.model_executor.models.registry import get_model_class
from kvserve.model_executor.models.vision_language import (
    LLAVA,
    VISION_LANGUAGE_ARCHITECTURES,
    image_token_id,
    text_config_dict,
)
from kvserve.quantization import QuantizedLinear, get_quantization_method, quantize_model
from kvserve.quantization.checkpoint import CheckpointFormat
from kvserve.quantization.registry import get_checkpoint_format

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: PreTrainedTokenizerBase | None  # None: dummy weights without a model dir, or skip_tokenizer_init
    quantization: str | None = None  # the checkpoint's own quant_method (GPTQ, AWQ, ...)
    # GGUF block type names of the file's tensors (e.g. {"Q4_1", "Q8_0", "F32"}), by tensor
    # name; empty for other formats. Lets `quantization=auto` see the source grid.
    gguf_tensor_types: dict[str, str] = field(default_factory=dict)
    gguf_path: str | None = None  # the GGUF file loaded, whose blocks pack_gguf_linears reads


def read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: cannot read JSON ({e})") from e


def _eos_ids(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


# config.json keys without which a dense model's shape is unknown.
REQUIRED_CONFIG_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                        "num_attention_heads")


def hf_model_config(model_dir: str, dtype: torch.dtype) -> ModelConfig:
    """ModelConfig from a Hugging Face config.json (+ generation_config.json for EOS);
    `model_dir` is the model's directory or its config.json itself."""
    if os.path.isfile(model_dir):
        config_path, model_dir = model_dir, os.path.dirname(model_dir)
    else:
        config_path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(config_path):
        raise ModelLoadError(f"{config_path}: no config.json in the model directory")
    cfg = read_json(config_path)
    if not cfg.get("architectures"):
        raise ModelLoadError(f"{config_path}: no 'architectures' entry naming the model class")
    architecture = cfg["architectures"][0]
    try:
        get_model_class(architecture)
    except ValueError as e:
        raise ModelLoadError(f"{config_path}: {e}") from None
    multimodal: dict[str, Any] = {}
    if architecture in VISION_LANGUAGE_ARCHITECTURES:
        cfg, multimodal = _vision_language_fields(architecture, cfg, config_path)
    missing = [key for key in REQUIRED_CONFIG_KEYS if key not in cfg]
    if missing:
        raise ModelLoadError(f"{config_path}: missing required keys {', '.join(missing)}")
    # transformers 5 folds rope_theta and scaling into `rope_parameters`.
    rope_parameters = dict(cfg.get("rope_parameters") or {})
    rope_theta = cfg.get("rope_theta") or rope_parameters.pop("rope_theta", 10000.0)
    rope_parameters.pop("rope_theta", None)
    rope_scaling = cfg.get("rope_scaling") or rope_parameters or None
    if rope_scaling and rope_scaling.get("mrope_section"):  # carried as ModelConfig.mrope_section
        rope_scaling = None
    if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
        rope_scaling = None
    eos = cfg.get("eos_token_id")
    generation_path = os.path.join(model_dir, "generation_config.json")
    generation = read_json(generation_path) if os.path.isfile(generation_path) else {}
    eos = generation.get("eos_token_id", eos)
    num_heads = cfg["num_attention_heads"]
    mistral_attention = architecture in ("MistralForCausalLM", "MixtralForCausalLM")
    sliding_window = cfg.get("sliding_window") if mistral_attention else None
    if cfg.get("use_sliding_window"):
        raise ModelLoadError(
            f"{config_path}: use_sliding_window=true ({architecture} with per-layer windows) "
            "is not supported"
        )
    try:
        return ModelConfig(
            architecture=architecture,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            # Qwen2 always has q/k/v biases; others say so with attention_bias.
            attention_bias=(architecture in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
                            or (multimodal and architecture != LLAVA)
                            or cfg.get("attention_bias", False)),
            qk_norm=architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            sliding_window=sliding_window,
            **_mixture_fields(architecture, cfg),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_eos_ids(eos),
            dtype=dtype,
            sampling_defaults=sampling_defaults(generation),
            **multimodal,
        )
    except KeyError as e:
        raise ModelLoadError(f"{config_path}: missing required key {e}") from None


def _vision_language_fields(
    architecture: str, cfg: dict[str, Any], config_path: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the decoder's config.json keys, ModelConfig's multimodal fields)."""
    try:
        text = text_config_dict(cfg)
        token_id = image_token_id(cfg)
    except (ValueError, TypeError, KeyError) as e:
        raise ModelLoadError(f"{config_path}: {architecture}: {e}") from None
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    section = rope.get("mrope_section")
    if architecture != LLAVA and not section:
        raise ModelLoadError(f"{config_path}: {architecture} needs rope mrope_section")
    text["architectures"] = cfg["architectures"]
    return text, dict(hf_config=cfg, image_token_id=token_id,
                      mrope_section=tuple(section) if architecture != LLAVA else None)


# generation_config.json keys that are sampling values, as SamplingParams names them.
SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(generation: dict[str, Any]) -> dict[str, float]:
    """The sampling values a generation_config.json sets. `do_sample: false` means greedy
    decoding in transformers, whatever temperature it lists: temperature 0 then."""
    defaults = {key: generation[key] for key in SAMPLING_DEFAULT_KEYS if generation.get(key) is not None}
    if defaults.get("top_k") == 0:  # transformers' "no top-k"
        defaults["top_k"] = -1
    if generation.get("do_sample") is False:
        return {"temperature": 0.0} | {k: v for k, v in defaults.items() if k == "repetition_penalty"}
    return defaults


def _mixture_fields(architecture: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's mixture-of-experts fields from a config.json (none for dense models)."""
    if architecture == "MixtralForCausalLM":
        return dict(num_experts=cfg["num_local_experts"], num_experts_per_tok=cfg["num_experts_per_tok"],
                    moe_intermediate_size=cfg["intermediate_size"], norm_topk_prob=True)
    if architecture not in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        return {}
    # Dense layers: those listed in mlp_only_layers, and all but every decoder_sparse_step-th.
    step, only_mlp = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or ())
    dense = tuple(i for i in range(cfg["num_hidden_layers"]) if i in only_mlp or (i + 1) % step)
    # Qwen's own configs say num_experts; transformers 5 writes num_local_experts.
    experts = cfg["num_experts"] if "num_experts" in cfg else cfg["num_local_experts"]
    return dict(num_experts=experts, num_experts_per_tok=cfg["num_experts_per_tok"],
                moe_intermediate_size=cfg["moe_intermediate_size"],
                norm_topk_prob=cfg.get("norm_topk_prob", False),
                shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size") or 0,
                dense_mlp_layers=dense)


def safetensors_files(model_dir: str) -> list[str]:
    index_path = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        names = sorted(set(read_json(index_path).get("weight_map", {}).values()))
    elif os.path.isfile(os.path.join(model_dir, "model.safetensors")):
        names = ["model.safetensors"]
    else:
        names = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    if not names:
        raise ModelLoadError(f"{model_dir}: no *.safetensors weight files found")
    files = [os.path.join(model_dir, n) for n in names]
    for path in files:
        if not os.path.isfile(path):
            raise ModelLoadError(f"{path}: weight file listed in the index is missing")
    return files


def _iter_safetensors(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    for path in tqdm(files, desc="Loading safetensors shards", disable=len(files) < 2):
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except ModelLoadError:
            raise
        except Exception as e:
            raise ModelLoadError(f"{path}: corrupt or truncated safetensors file ({e})") from e


def _empty_model(config: ModelConfig, device: str | torch.device) -> LlamaForCausalLM:
    """Build on the meta device, then allocate uninitialized storage directly on `device`
    in the run dtype: no CPU copy and no wasted random init (matters for 8B on a GPU)."""
    with torch.device("meta"):
        model = get_model_class(config.architecture)(config)
    return model.to(config.dtype).to_empty(device=device).eval()


def materialize(model: LlamaForCausalLM, device: str | torch.device) -> LlamaForCausalLM:
    """Allocate the tensors still on the meta device (those the checkpoint fills as floats)
    and move the already built quantized layers to `device`."""
    model = model._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t)
    return model.to(device).eval()


def _load_into(model: LlamaForCausalLM, weights: Iterator[tuple[str, torch.Tensor]], source: str) -> None:
    try:
        model.load_weights(weights)
    except ModelLoadError:
        raise
    except ValueError as e:
        raise ModelLoadError(f"{source}: {e}") from e


# A Hugging Face directory holds its tokenizer in one of these.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _load_tokenizer(
    source: str, load: Callable[[str], PreTrainedTokenizerBase] = AutoTokenizer.from_pretrained,
) -> PreTrainedTokenizerBase:
    if os.path.isdir(source) and not any(os.path.exists(os.path.join(source, f)) for f in TOKENIZER_FILES):
        raise ModelLoadError(
            f"{source}: no tokenizer files ({', '.join(TOKENIZER_FILES)}); pass tokenizer=<directory> "
            "(--tokenizer) for one kept elsewhere, or skip_tokenizer_init=True (--skip-tokenizer-init) "
            "to run on token ids"
        )
    try:
        return load(source)
    except Exception as e:
        raise ModelLoadError(f"{source}: cannot load the tokenizer ({e})") from e


def load_tokenizer(source: str) -> PreTrainedTokenizerBase:
    """The tokenizer of a Hugging Face directory or a GGUF file (its vocabulary)."""
    if not os.path.exists(source):
        raise ModelLoadError(f"tokenizer {source}: no such file or directory")
    if os.path.isfile(source):
        from kvserve.model_executor.gguf_tokenizer import load_gguf_tokenizer

        return _load_tokenizer(source, load=load_gguf_tokenizer)
    return _load_tokenizer(source)


def _load_hf_dir(model_dir: str, dtype: torch.dtype, device: str | torch.device) -> LoadedModel:
    config = hf_model_config(model_dir, dtype)
    config_path = os.path.join(model_dir, "config.json")
    quantization_config = read_json(config_path).get("quantization_config")
    files = safetensors_files(model_dir)
    if not quantization_config:
        model = _empty_model(config, device)
        _load_into(model, _iter_safetensors(files), model_dir)
        return LoadedModel(model, config, None)
    try:
        fmt = get_checkpoint_format(quantization_config, config_path)
    except ValueError as e:
        raise ModelLoadError(str(e)) from None
    # Packed checkpoints are small: read them whole, build the quantized layers from their
    # tensors on the meta model (no float copy of those weights), load the rest as usual.
    tensors = dict(_iter_safetensors(files))
    with torch.device("meta"):
        model = get_model_class(config.architecture)(config).to(dtype)
    try:
        _install_checkpoint_layers(model, fmt, tensors)
    except ValueError as e:
        raise ModelLoadError(f"{model_dir}: {e}") from e
    model = materialize(model, device)
    _load_into(model, iter(tensors.items()), model_dir)
    return LoadedModel(model, config, None, quantization=fmt.quant_method)


def stored_quantized(module_name: str, shards: list[str], fmt: CheckpointFormat,
                     tensors: dict[str, torch.Tensor]) -> bool:
    """Whether the checkpoint stores the shards of this (fused) linear quantized: all of them
    or none, since they become one layer."""
    packed = [f"{hf}.{fmt.packed_suffix}" in tensors for hf in shards]
    if any(packed) and not all(packed):
        raise ValueError(f"{module_name}: only some of {shards} are quantized; they are fused "
                         "into one layer, so all or none must be")
    return all(packed)


def _install_checkpoint_layers(
    model: LlamaForCausalLM, fmt: CheckpointFormat, tensors: dict[str, torch.Tensor]
) -> None:
    """Swap each linear whose shards the checkpoint stores quantized for the layer the
    format builds from them (the format removes the tensors it consumes; act-order grids
    come back as exact fp32 `.weight` tensors for the float layer instead)."""
    for module_name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or module_name.rsplit(".", 1)[-1] == "lm_head":
            continue
        shards = model.hf_shard_names(module_name)
        if not stored_quantized(module_name, shards, fmt, tensors):
            continue
        layer = fmt.linear(tensors, shards, module.bias)
        if layer is not None:
            parent, _, attr = module_name.rpartition(".")
            setattr(model.get_submodule(parent), attr, layer)


def _load_gguf(path: str, dtype: torch.dtype, device: str | torch.device, packed: bool) -> LoadedModel:
    # Imported here so that safetensors and dummy loading work without the gguf package.
    from kvserve.model_executor.gguf_loader import (
        gguf_architecture,
        gguf_model_config,
        install_packed_linears,
        iter_gguf_weights,
        open_gguf,
    )

    reader = open_gguf(path)
    config = gguf_model_config(reader, path, dtype)
    arch = gguf_architecture(reader)
    if packed:
        # Packed layers replace their float linears while those are still on the meta
        # device, so no float copy of the quantized weights is ever allocated.
        with torch.device("meta"):
            model = get_model_class(config.architecture)(config).to(dtype)
        consumed = install_packed_linears(model, reader, path, config, arch, device)
        model = materialize(model, device)
    else:
        model, consumed = _empty_model(config, device), set()
    _load_into(model, iter_gguf_weights(reader, path, config, arch, skip=consumed), path)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    return LoadedModel(model, config, None, gguf_tensor_types=types, gguf_path=path)


def pack_gguf_linears(loaded: LoadedModel) -> None:
    """Replace the float linears of a model loaded from a GGUF file by layers built from the
    file's own blocks (quantization=gguf's layers: the same weights, exactly), as
    `quantization=auto` does on CPU for files whose blocks no re-quantization reproduces."""
    from kvserve.model_executor.gguf_loader import gguf_architecture, install_packed_linears, open_gguf

    if loaded.gguf_path is None:
        raise ValueError("pack_gguf_linears needs a model loaded from a GGUF file")
    reader = open_gguf(loaded.gguf_path)
    device = next(loaded.model.parameters()).device
    install_packed_linears(loaded.model, reader, loaded.gguf_path, loaded.config, gguf_architecture(reader), device)


def _load_dummy(
    model: str | None, model_shape: str | None, dtype: torch.dtype,
    device: str | torch.device, seed: int,
) -> LoadedModel:
    if model_shape is not None:
        config = dummy_model_config(model_shape, dtype)
    elif model is not None and os.path.isdir(model):
        config = hf_model_config(model, dtype)
    else:
        raise ValueError("load_format='dummy' needs model_shape or a model directory")
    net = _empty_model(config, device)
    init_dummy_weights(net, seed)
    return LoadedModel(net, config, None)


def load_model(
    model: str | None,
    *,
    load_format: str = "auto",
    model_shape: str | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    quantization: str | None = None,
    quantization_config: dict[str, Any] | None = None,
    tokenizer: str | None = None,
    skip_tokenizer_init: bool = False,
) -> LoadedModel:
    """Load a model for inference. `model` is a Hugging Face directory, a .gguf file, or
    None for the embedded default (SmolLM2-135M-Instruct Q4_1). `quantization` names a
    weight-only method applied to the linear layers once the weights are loaded. The
    tokenizer is the model's own, or the one at `tokenizer` (a directory or .gguf file), or
    none with `skip_tokenizer_init`."""
    if tokenizer is not None and skip_tokenizer_init:
        raise ValueError("tokenizer and skip_tokenizer_init exclude each other: give one")
    # Resolved first so that a bad method, config or tokenizer fails before any weight is read.
    method = get_quantization_method(quantization, quantization_config)
    gguf_packed = method is not None and method.name == "gguf"
    chosen_tokenizer = None if tokenizer is None else load_tokenizer(tokenizer)
    loaded, source = _load_weights(model, load_format, model_shape, dtype, device, seed, gguf_packed)
    if chosen_tokenizer is not None:
        loaded.tokenizer = chosen_tokenizer
    elif source is not None and not skip_tokenizer_init:
        loaded.tokenizer = load_tokenizer(source)
    if gguf_packed:
        packed = [m for m in loaded.model.modules() if isinstance(m, QuantizedLinear)]
        logger.info(
            "quantization=gguf: %d linear layers kept packed, %.1f MB (fp32: %.1f MB)",
            len(packed), sum(m.weight_bytes() for m in packed) / 1e6,
            sum(4 * m.in_features * m.out_features for m in packed) / 1e6,
        )
    elif loaded.quantization is not None and method is None:
        packed = [m for m in loaded.model.modules() if isinstance(m, QuantizedLinear)]
        logger.info("checkpoint quantization %s: %d linear layers, %.1f MB",
                    loaded.quantization, len(packed), sum(m.weight_bytes() for m in packed) / 1e6)
    elif method is not None and loaded.quantization is not None:
        raise ModelLoadError(
            f"{model}: the checkpoint is already quantized ({loaded.quantization}); "
            f"quantization={quantization!r} applies to float checkpoints only"
        )
    elif method is not None:
        report = quantize_model(loaded.model, method)
        logger.info(
            "quantization=%s: linear weights %.1f MB -> %.1f MB (%d layers)",
            report.method, report.bytes_before / 1e6, report.bytes_after / 1e6, report.num_layers,
        )
    return loaded


def _load_weights(
    model: str | None, load_format: str, model_shape: str | None, dtype: torch.dtype,
    device: str | torch.device, seed: int, gguf_packed: bool,
) -> tuple[LoadedModel, str | None]:
    """The weights (no tokenizer yet) and where the model's own tokenizer is: the GGUF file
    or directory loaded, None for dummy weights in a named shape."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; expected one of {LOAD_FORMATS}")
    if gguf_packed and (load_format == "dummy" or (model is not None and os.path.isdir(model))):
        raise ModelLoadError(
            f"quantization='gguf' keeps a GGUF file's blocks packed; got "
            f"{'dummy weights' if load_format == 'dummy' else 'the directory ' + repr(model)}"
        )
    if load_format == "dummy":
        return _load_dummy(model, model_shape, dtype, device, seed), None if model_shape is not None else model
    if model is None:
        try:
            model = default_model_path()
        except FileNotFoundError as e:
            raise ModelLoadError(str(e)) from None
    if not os.path.exists(model):
        raise ModelLoadError(f"{model}: no such file or directory")
    if load_format == "gguf" or (load_format == "auto" and os.path.isfile(model)):
        if os.path.isdir(model):
            raise ModelLoadError(f"{model}: load_format='gguf' needs a .gguf file, got a directory")
        return _load_gguf(model, dtype, device, gguf_packed), model
    if not os.path.isdir(model):
        raise ModelLoadError(f"{model}: expected a Hugging Face model directory")
    return _load_hf_dir(model, dtype, device), model
