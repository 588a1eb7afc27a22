"""Host cost of incremental detokenization a token: SmolLM2's tokenizer (the embedded GGUF's
byte-level BPE) streaming a text file's tokens one at a time, best of several runs.

    PYTHONPATH=. python benchmarks/cpu_detokenizer.py [--tokens 3000] [--runs 5]
"""

from __future__ import annotations

import argparse
import time

from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.model_executor.gguf_tokenizer import load_gguf_tokenizer
from kvserve.model_executor.loader import default_model_path
from kvserve.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text", default="README.md",
                        help="Text file whose tokens are streamed (default: README.md).")
    parser.add_argument("--tokens", type=int, default=3000,
                        help="Tokens streamed per run (default: 3000).")
    parser.add_argument("--runs", type=int, default=5, help="Timed runs; the best is printed (default: 5).")
    args = parser.parse_args()

    tokenizer = load_gguf_tokenizer(default_model_path())
    with open(args.text) as file:
        ids = tokenizer.encode(file.read(), add_special_tokens=False)
    num_tokens = min(args.tokens, len(ids) - 5)
    params = SamplingParams(max_tokens=num_tokens)

    def stream() -> float:
        start = time.perf_counter()
        detokenizer = IncrementalDetokenizer(tokenizer, ids[:5], params)
        for token in ids[5 : 5 + num_tokens]:
            detokenizer.add_tokens([token])
        return time.perf_counter() - start

    stream()
    print(f"{min(stream() for _ in range(args.runs)) / num_tokens * 1e6:.2f} us a token ({num_tokens} tokens)")


if __name__ == "__main__":
    main()
