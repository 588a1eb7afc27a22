"""What fp8 activations cost in perplexity, on top of fp8 weights: CUDA runs fp8 linears on
17+ rows as W8A8 (x quantized to e4m3 per token: fp8_w8a8, `_scaled_mm`), the CPU upcasts
the weights and keeps x in fp32. Here the CPU path is run twice on the embedded SmolLM2:
as it is, and with every fp8 linear's input rounded through the same per-token e4m3
quantization first (the GPU's numerics up to fp32 summation order). Same text and windows
as benchmarks/quality_smollm2.sh; the fp32 reference is the fp32.json that script writes.
CPU; about 5 minutes on 2 cores.

    python benchmarks/fp8_activations_quality.py [--results-dir benchmarks/results/quality-smollm2]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kvserve import LLM
from kvserve.eval.perplexity import perplexity
from kvserve.quantization.fp8 import FP8_DTYPE, FP8_MAX, Fp8Linear

LICENSES = ("GPL-3", "GFDL-1.3", "Apache-2.0", "LGPL-3", "MPL-2.0")


def per_token_fp8(x: torch.Tensor) -> torch.Tensor:
    """x rounded as quantize_per_token rounds it: each row's absolute maximum to 448."""
    scale = x.float().abs().amax(-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return (q.float() * scale).to(x.dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results-dir", default="benchmarks/results/quality-smollm2",
                        help="Folder holding quality_smollm2.sh's fp32.json; fp8_activations.json is written "
                             "there (default: benchmarks/results/quality-smollm2).")
    args = parser.parse_args()
    results_dir = Path(args.results_dir)
    text = "".join(Path("/usr/share/common-licenses", name).read_text() for name in LICENSES)
    reference = json.loads((results_dir / "fp32.json").read_text())["perplexity"]
    results = {"fp32": reference}
    apply = Fp8Linear.apply
    for name in ("fp8-weights", "fp8-weights-and-activations"):
        if name.endswith("activations"):
            Fp8Linear.apply = lambda self, x: apply(self, per_token_fp8(x))
        llm = LLM(model=None, quantization="fp8", kv_cache_memory="1GiB", compile_decode=False)
        result = perplexity(llm, llm.get_tokenizer()(text).input_ids)
        results[name] = result.perplexity
        print(f"{name:28s} perplexity {result.perplexity:.4f} ({result.perplexity / reference - 1:+.2%} vs fp32), "
              f"{result.num_scored_tokens} tokens, {result.elapsed_s:.0f} s", flush=True)
        del llm
    Fp8Linear.apply = apply
    (results_dir / "fp8_activations.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
