"""Host cost of incremental detokenization a token: SmolLM2's tokenizer (the embedded GGUF's
byte-level BPE) streaming 3,000 tokens of README.md one at a time, best of 5 runs.

    PYTHONPATH=. python benchmarks/cpu_detokenizer.py
"""

from __future__ import annotations

import time

from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.model_executor.gguf_tokenizer import load_gguf_tokenizer
from kvserve.model_executor.loader import default_model_path
from kvserve.sampling_params import SamplingParams

TOKENS = 3000


def main() -> None:
    tokenizer = load_gguf_tokenizer(default_model_path())
    with open("README.md") as file:
        ids = tokenizer.encode(file.read(), add_special_tokens=False)
    params = SamplingParams(max_tokens=TOKENS)

    def stream() -> float:
        start = time.perf_counter()
        detokenizer = IncrementalDetokenizer(tokenizer, ids[:5], params)
        for token in ids[5 : 5 + TOKENS]:
            detokenizer.add_tokens([token])
        return time.perf_counter() - start

    stream()
    print(f"{min(stream() for _ in range(5)) / TOKENS * 1e6:.2f} us a token")


if __name__ == "__main__":
    main()
