"""What a quantized LM head alone costs in perplexity: the embedded SmolLM2 with fp32 linears
and its head (the tied embedding) as fp32, int8 per-channel, or int4 g32 / g64, the quantized
head computing every position's logits (its decode kernel made to take all rows). Same text
and windows as benchmarks/quality_smollm2.sh. CPU; about 20 minutes on 2 cores.

    python benchmarks/lm_head_quality.py [--output benchmarks/results/quality-smollm2/lm_head.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvserve import LLM
from kvserve.eval.perplexity import perplexity
from kvserve.quantization.int4 import Int4Method
from kvserve.quantization.int8 import quantize_lm_head

LICENSES = ("GPL-3", "GFDL-1.3", "Apache-2.0", "LGPL-3", "MPL-2.0")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default="benchmarks/results/quality-smollm2/lm_head.json",
                        help="JSON file for the perplexities (default: "
                             "benchmarks/results/quality-smollm2/lm_head.json).")
    args = parser.parse_args()
    text = "".join(Path("/usr/share/common-licenses", name).read_text() for name in LICENSES)
    results = {}
    for name in ("fp32", "int8", "int4-g32", "int4-g64"):
        llm = LLM(model=None, kv_cache_memory="1GiB", compile_decode=False)
        model = llm.engine.core.runner.model
        if name == "int8":
            quantize_lm_head(model)
        elif name.startswith("int4"):
            Int4Method({"lm_head": True, "group_size": int(name[-2:])}).quantize_lm_head(model)
        if model.quantized_lm_head is not None:
            model.quantized_lm_head.cpu_kernel_max_rows = 1 << 30  # every position, not only decode rows
        result = perplexity(llm, llm.get_tokenizer()(text).input_ids)
        results[name] = result.perplexity
        print(f"{name:9s} perplexity {result.perplexity:.4f} ({result.perplexity / results['fp32'] - 1:+.2%} vs fp32 head), "
              f"{result.num_scored_tokens} tokens, {result.elapsed_s:.0f} s", flush=True)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
