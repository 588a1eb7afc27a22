"""Every environment variable kvserve reads, in one place: its name, default and meaning.

A variable is read when its attribute is (`envs.KVSERVE_PDL`), not when this module is
imported, so one set later (a test's monkeypatch, a benchmark's side-by-side runs) takes
effect. Plain data on the standard library alone: every package may import it, kvserve.ops
included (tests/test_import_rule.py).

kvserve sets one variable instead of reading it: GOMP_SPINCOUNT, in the `kvserve` command
before torch loads (entrypoints/cli.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    KVSERVE_CACHE_DIR: Path
    KVSERVE_PDL: bool
    KVSERVE_DENSE_GEMV: bool
    KVSERVE_FUSED_NORMS: bool
    KVSERVE_QUANTIZED_GPU_KERNELS: bool
    KVSERVE_LORA_SGMV_MIN_TOKENS: int
    KVSERVE_API_KEY: str | None
    KVSERVE_PP_LAYER_PARTITION: str | None
    KVSERVE_EP_DISPATCH: str
    KVSERVE_LLAMA_CPP_DIR: Path
    KVSERVE_CPU_ARCH_FLAGS: list[str]
    OPENAI_API_KEY: str | None
    TRITON_INTERPRET: bool
    TORCH_EXTENSIONS_DIR: str | None


def _cache_dir() -> Path:
    return Path(os.environ.get("KVSERVE_CACHE_DIR") or Path.home() / ".cache" / "kvserve")


environment_variables: dict[str, Callable[[], Any]] = {
    # What kvserve keeps between starts (the CPU defaults' measurements, tokenizers converted
    # from GGUF files); default ~/.cache/kvserve.
    "KVSERVE_CACHE_DIR": _cache_dir,
    # Programmatic dependent launch of the decode step's kernels on sm_90 and newer
    # (ops/pdl.py); "0" turns it off, for side-by-side timing.
    "KVSERVE_PDL": lambda: os.environ.get("KVSERVE_PDL", "1") != "0",
    # "0": a decode step's one-row bf16/fp16 linears go to cuBLAS instead of kvserve's
    # dependent-launch GEMV (ops/dense_gemv.py), for side-by-side timing.
    "KVSERVE_DENSE_GEMV": lambda: os.environ.get("KVSERVE_DENSE_GEMV", "1") != "0",
    # "0": every RMSNorm between two linears runs its own add+RMSNorm kernel, where decode
    # rows would run it inside the layers around it (PendingNorm, RMSNorm.add_after: the
    # int4/fp8 kernels, a mixture of experts' routing and combine with the dense bf16/fp16
    # GEMV beside it at one row on Hopper), for side-by-side timing. Read as a step runs: a CUDA graph keeps
    # what its capture read.
    "KVSERVE_FUSED_NORMS": lambda: os.environ.get("KVSERVE_FUSED_NORMS", "1") != "0",
    # "0": quantized linears built while it is set run every CUDA call on the dequantize path
    # instead of kvserve's kernels (the reference those are tested against).
    "KVSERVE_QUANTIZED_GPU_KERNELS": lambda: os.environ.get("KVSERVE_QUANTIZED_GPU_KERNELS", "1") != "0",
    # LoRA layers built while it is set run steps of at least this many tokens on the CUDA
    # grouped (SGMV) kernels and smaller ones on the per-token (BGMV) kernels (ops/lora.py);
    # default 32. "1": always grouped; a number above any step: always per token.
    "KVSERVE_LORA_SGMV_MIN_TOKENS": lambda: int(os.environ.get("KVSERVE_LORA_SGMV_MIN_TOKENS") or 32),
    # Layers per pipeline stage, comma-separated ("12,10,10"), instead of an even split.
    "KVSERVE_PP_LAYER_PARTITION": lambda: os.environ.get("KVSERVE_PP_LAYER_PARTITION"),
    # How an expert-parallel mixture of experts combines its ranks' work: "all_to_all" (tokens
    # sent to their experts' ranks and back), "all_reduce" (every rank's part of every token
    # summed), or "auto" (default: whichever sends fewer bytes for the step's token count;
    # layers/moe.py use_all_to_all).
    "KVSERVE_EP_DISPATCH": lambda: os.environ.get("KVSERVE_EP_DISPATCH", "auto"),
    # The key `kvserve serve` requires of clients (its --api-key default); unset: none.
    "KVSERVE_API_KEY": lambda: os.environ.get("KVSERVE_API_KEY"),
    # Where `kvserve bench cpu-compare` builds and keeps llama.cpp's llama-server; default
    # ~/.cache/kvserve/llama.cpp.
    "KVSERVE_LLAMA_CPP_DIR": lambda: Path(os.environ.get("KVSERVE_LLAMA_CPP_DIR")
                                          or Path.home() / ".cache" / "kvserve" / "llama.cpp"),
    # The compiler's instruction-set flags for kvserve's CPU kernels (ops/cpu), space-separated;
    # default "-march=native". Another set ("-march=native -mno-avx512f": the AVX2 code; "-march=
    # x86-64": the portable one) builds in a directory of its own: how the tests check the code
    # paths this CPU would not take.
    "KVSERVE_CPU_ARCH_FLAGS": lambda: (os.environ.get("KVSERVE_CPU_ARCH_FLAGS") or "-march=native").split(),
    # The bearer token `kvserve bench serve` sends to the server it loads (its --api-key
    # default), as OpenAI's clients read it.
    "OPENAI_API_KEY": lambda: os.environ.get("OPENAI_API_KEY"),
    # "1": Triton runs kernels in its interpreter, on the CPU (Triton reads it when imported).
    # kvserve then allows the Triton attention backend on a CPU device and leaves out what
    # the interpreter cannot run (inline PTX, dependent launch).
    "TRITON_INTERPRET": lambda: os.environ.get("TRITON_INTERPRET") == "1",
    # Where torch builds C++ extensions: kvserve's CPU kernels build under it (ops/cpu);
    # unset: torch's default root.
    "TORCH_EXTENSIONS_DIR": lambda: os.environ.get("TORCH_EXTENSIONS_DIR"),
}


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(environment_variables)
