"""One Llama-family decoder (Llama 2/3, Mistral, Mixtral, Qwen2/2.5, Qwen2-MoE, Qwen3,
Qwen3-MoE, SmolLM2) on a paged KV cache, parameterised by ModelConfig. q/k/v and gate/up are
fused into single linears, in experts too (layers/moe.py)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import torch
from torch import nn

from kvserve.attention.backend import AttentionBackend
from kvserve.attention.metadata import AttentionMetadata
from kvserve.attention.torch_ref import FLOAT8_DTYPES, TorchReferenceBackend
from kvserve.config import ModelConfig
from kvserve.distributed.parallel_state import GroupCoordinator
from kvserve.model_executor.layers.layernorm import RMSNorm
from kvserve.model_executor.layers.linear import Linear, linear
from kvserve.model_executor.layers.mlp import GatedMLP
from kvserve.model_executor.layers.moe import SparseMoE
from kvserve.model_executor.layers.rotary import MRotaryEmbedding, RotaryEmbedding, apply_rotary
from kvserve.ops.pending_norm import PendingNorm


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.attn_backend = attn_backend
        # (k, v) dequantization scales of a float8 KV cache, set by the model runner.
        self.kv_scales = (1.0, 1.0)

    def forward(
        self,
        hidden_states: torch.Tensor | PendingNorm,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """The attention heads' output, [T, heads x head_dim]: o_proj's input (the decoder
        layer applies o_proj, fused with the norm after it where it can)."""
        q_and_k, v = self.qkv_proj(hidden_states).split(
            [self.q_size + self.kv_size, self.kv_size], dim=-1
        )
        num_tokens = q_and_k.shape[0]
        heads = q_and_k.view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        float8 = kv_cache.dtype in FLOAT8_DTYPES
        q, k = heads.split([self.num_heads, self.num_kv_heads], dim=1)
        adjacent = True  # q's and k's heads still one view of the projection
        if self.qk_norm and heads.is_cuda and self.q_norm.weight.dtype == heads.dtype:
            from kvserve.ops.elementwise import qk_rms_norm_

            qk_rms_norm_(heads, self.num_heads, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        elif self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
            adjacent = False
        # The backend applies RoPE where it saves launches (at decode, inside its attention
        # kernel); a float8 cache's keys change basis after RoPE, so those rotate here.
        rotary = (cos, sin) if self.attn_backend.fuses_rotary and not float8 else None
        if rotary is None and not adjacent:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            if float8:
                q, k = self.attn_backend.to_key_basis(q), self.attn_backend.to_key_basis(k)
        elif rotary is None:
            # q and k are adjacent heads of the fused projection: one rotary launch (and one
            # basis change for a float8 cache) covers both.
            heads = apply_rotary(heads, cos, sin)
            if float8:
                heads = self.attn_backend.to_key_basis(heads)
            q, k = heads.split([self.num_heads, self.num_kv_heads], dim=1)
        out = self.attn_backend.forward(
            q, k, v, kv_cache, attn_metadata, self.scale, self.kv_scales, rotary
        )
        return out.reshape(num_tokens, self.q_size)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, attn_backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # The MLP, dense or a mixture, under its Hugging Face name ("mlp"; Mixtral's mixture
        # "block_sparse_moe"), so that checkpoint names map to ours.
        if config.num_experts and index not in config.dense_mlp_layers:
            self.mlp_name = "block_sparse_moe" if config.architecture == "MixtralForCausalLM" else "mlp"
            self.add_module(self.mlp_name, SparseMoE(
                config.hidden_size, config.moe_intermediate_size, config.num_experts,
                config.num_experts_per_tok, config.norm_topk_prob, config.shared_expert_intermediate_size))
        else:
            self.mlp_name = "mlp"
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)

    def forward(
        self,
        hidden_states: torch.Tensor | PendingNorm,
        residual: torch.Tensor,
        next_norm: RMSNorm,
        next_linear: nn.Module | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor | PendingNorm, torch.Tensor]:
        """hidden_states: the input norm's output (the previous layer applied it); returns
        next_norm(residual stream after this layer), whose output next_linear takes (None:
        the LM head), and that stream. Each residual add is fused into the norm after it, and
        each norm, where the kernels can, into the linears around it (RMSNorm.add_after)."""
        attn_out = self.self_attn(hidden_states, cos, sin, kv_cache, attn_metadata)
        mlp = getattr(self, self.mlp_name)
        if isinstance(mlp, SparseMoE):
            # The whole mixture stands where gate/up (it may finish the norm before it) and
            # down_proj do.
            hidden_states, residual = self.post_attention_layernorm.add_after(
                self.self_attn.o_proj, attn_out, residual, mlp
            )
            return next_norm.add_after(mlp, hidden_states, residual, next_linear)
        hidden_states, residual = self.post_attention_layernorm.add_after(
            self.self_attn.o_proj, attn_out, residual, mlp.gate_up_proj
        )
        return next_norm.add_after(mlp.down_proj, mlp(hidden_states), residual, next_linear)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend) -> None:
        super().__init__()
        # Uninitialized (the checkpoint fills it): nn.Embedding's own normal_ init of a meta
        # tensor goes through torch._refs, which imports Dynamo (~1.2 s of every start).
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, attn_backend, index) for index in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = (
            MRotaryEmbedding(config.head_dim, config.rope_theta, config.mrope_section)
            if config.mrope_section else
            RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        )
        self.hidden_size, self.dtype = config.hidden_size, config.dtype
        # Set by pipeline_parallel.keep_stage: this stage runs only its own layers.
        self.pp_group: GroupCoordinator | None = None

    @property
    def is_last_stage(self) -> bool:
        return self.pp_group is None or self.pp_group.is_last_rank

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
        residual_streams: dict[int, torch.Tensor | None] | None = None,
    ) -> torch.Tensor:
        """The final norm's output; a pipeline stage other than the last sends its residual
        stream to the next stage instead (and returns it). `inputs_embeds` replaces the
        token embeddings (images merged in); `positions` is [3, T] under M-RoPE.
        `residual_streams`: keyed by layer index, filled with the residual stream entering
        each of those layers (what EAGLE-3 heads read)."""
        cos, sin = self.rotary.cos_sin(positions)
        pp = self.pp_group
        if inputs_embeds is not None:
            residual = inputs_embeds
        elif pp is None or pp.is_first_rank:
            residual = self.embed_tokens(input_ids)
        else:
            residual = pp.recv_from_previous((input_ids.shape[0], self.hidden_size), self.dtype, input_ids.device)
        hidden_states = self.layers[0].input_layernorm(residual)
        last_norm = self.norm if self.is_last_stage else _StageEnd()
        next_norms = [layer.input_layernorm for layer in self.layers[1:]] + [last_norm]
        next_linears = [layer.self_attn.qkv_proj for layer in self.layers[1:]] + [None]
        for index, (layer, next_norm, next_linear, kv_cache) in enumerate(zip(
            self.layers, next_norms, next_linears, kv_caches, strict=True
        )):
            if residual_streams is not None and index in residual_streams:
                # A copy: on CUDA the fused norms add into the residual stream in place.
                residual_streams[index] = residual.clone()
            hidden_states, residual = layer(
                hidden_states, residual, next_norm, next_linear, cos, sin, kv_cache, attn_metadata
            )
        if not self.is_last_stage:
            pp.send_to_next(residual)
        return hidden_states


class _StageEnd:
    """Where a pipeline stage's last layer would apply the next layer's norm: only the
    residual add (the next stage norms what it receives)."""

    @staticmethod
    def add_after(linear: nn.Module, x: torch.Tensor, residual: torch.Tensor,
                  consumer: nn.Module | None) -> tuple[torch.Tensor, torch.Tensor]:
        residual = residual + linear(x)
        return residual, residual


# Our fused linears -> the Hugging Face linears stacked into them (by output rows), in order.
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# Where a checkpoint names an expert's linears otherwise than Llama's MLP.
_EXPERT_LINEAR_NAMES = {"MixtralForCausalLM": {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}}


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(
            config, attn_backend or TorchReferenceBackend(config.sliding_window)
        )
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        # Set by quantize_lm_head: a weight-only copy of the LM head for decode-sized rows.
        self.quantized_lm_head: nn.Module | None = None
        # Set by tensor_parallel.shard_model: this rank computes its slice of the vocabulary.
        self.tp_group: GroupCoordinator | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
        residual_streams: dict[int, torch.Tensor | None] | None = None,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, attn_metadata, inputs_embeds, residual_streams)

    @property
    def is_last_stage(self) -> bool:
        """Whether this process computes logits (pipeline parallelism: the last stage)."""
        return self.model.is_last_stage

    @property
    def graph_capturable(self) -> bool:
        """Whether a step's work is fixed by its input shapes, as CUDA graphs and
        torch.compile need: not for a mixture of experts whose experts stay unpacked, which
        reads on the host which experts to run (SparseMoE)."""
        return all(m.packed for m in self.modules() if isinstance(m, SparseMoE))

    def pack_experts(self) -> None:
        """Stack each mixture-of-experts layer's dense experts for the fused paths (once the
        weights are loaded, quantized and sharded)."""
        for module in self.modules():
            if isinstance(module, SparseMoE):
                module.pack_experts()

    def set_attn_backend(self, attn_backend: AttentionBackend) -> None:
        """Swap the attention implementation (the model runner picks it per device)."""
        for layer in self.model.layers:
            layer.self_attn.attn_backend = attn_backend

    def compute_logits(self, hidden_states: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits [T, vocab] of hidden_states [T, H]; written into `out` ([T, vocab] fp32)
        where given: CUDA graphs share one output buffer."""
        if self.quantized_lm_head is not None:
            logits = self.quantized_lm_head(hidden_states)
        else:
            weight = self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
            logits = linear(hidden_states, weight)
        if self.tp_group is not None:  # every rank's slice, without the padding
            logits = self.tp_group.all_gather(logits)[:, : self.config.vocab_size]
        return logits.float() if out is None else out.copy_(logits)

    def shard_sizes(self, module_name: str) -> list[int]:
        """Output rows of each Hugging Face linear stacked into one of ours (hf_shard_names)."""
        c = self.config
        leaf = module_name.rpartition(".")[2]
        if leaf == "qkv_proj":
            kv = c.num_key_value_heads * c.head_dim
            return [c.num_attention_heads * c.head_dim, kv, kv]
        rows = self.get_submodule(module_name).out_features
        return [rows // 2, rows // 2] if leaf == "gate_up_proj" else [rows]

    def hf_shard_names(self, module_name: str) -> list[str]:
        """Hugging Face names of the linears stacked (by output rows) into one of ours."""
        prefix, _, leaf = module_name.rpartition(".")
        leaves = _FUSED.get(leaf, (leaf,))
        if ".experts." in f".{prefix}.":
            renames = _EXPERT_LINEAR_NAMES.get(self.config.architecture, {})
            leaves = tuple(renames.get(name, name) for name in leaves)
        return [f"{prefix}.{name}" if prefix else name for name in leaves]

    def hf_weight_views(self) -> dict[str, torch.Tensor]:
        """Hugging Face parameter name -> the view of our parameter it fills."""
        targets: dict[str, torch.Tensor] = {}
        for name, param in self.named_parameters():
            module_name, _, kind = name.rpartition(".")
            shards = self.hf_shard_names(module_name)
            if len(shards) == 1:
                targets[f"{shards[0]}.{kind}"] = param
                continue
            sizes = self.shard_sizes(module_name)
            for hf_name, start, size in zip(shards, itertools.accumulate([0] + sizes), sizes):
                targets[f"{hf_name}.{kind}"] = param.narrow(0, start, size)
        return targets

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the (possibly fused) parameters, checking
        that every parameter is filled and nothing unknown or misshapen is given."""
        targets = self.hf_weight_views()
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # some tied checkpoints store a copy of the embedding
            if name not in targets:
                raise ValueError(f"unexpected weight {name!r} for {self.config.architecture}")
            target = targets[name]
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(target.shape)}"
                )
            target.copy_(tensor)
            loaded.add(name)
        missing = sorted(set(targets) - loaded)
        if missing:
            more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
            raise ValueError(f"missing weights: {', '.join(missing[:10])}{more}")
