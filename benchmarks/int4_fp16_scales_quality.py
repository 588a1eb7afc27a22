"""Perplexity of SmolLM2 with int4 linears, their scales and minimums in fp32 and then
rounded through fp16 (what Int4Linear stores on CUDA), on the held text of
benchmarks/quality_smollm2.sh; CPU, so the fp16 rounding is simulated in fp32 buffers.

    python benchmarks/int4_fp16_scales_quality.py [--file /tmp/kvserve_quality_text.txt]
"""

from __future__ import annotations

import argparse
import json

from kvserve import LLM
from kvserve.eval.perplexity import perplexity
from kvserve.quantization.int4 import Int4Linear, fits_fp16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--file", default="/tmp/kvserve_quality_text.txt", help="Text to score.")
    args = parser.parse_args()
    with open(args.file, encoding="utf-8") as f:
        text = f.read()
    for group_size in (64, 32):
        llm = LLM(quantization="int4", quantization_config={"group_size": group_size, "lm_head": False},
                  kv_cache_memory="1GiB")
        ids = llm.get_tokenizer()(text).input_ids
        fp32 = perplexity(llm, ids)
        layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, Int4Linear)]
        fits = all(fits_fp16(m.scale) and fits_fp16(m.minimum) for m in layers)
        for m in layers:
            m.scale.copy_(m.scale.half().float())
            m.minimum.copy_(m.minimum.half().float())
        fp16 = perplexity(llm, ids)
        print(json.dumps({"group_size": group_size, "layers": len(layers), "all_fit_fp16": fits,
                          "fp32_scales": fp32.perplexity, "fp16_scales": fp16.perplexity,
                          "change_pct": 100 * (fp16.perplexity / fp32.perplexity - 1),
                          "scored": fp32.num_scored_tokens}), flush=True)


if __name__ == "__main__":
    main()
