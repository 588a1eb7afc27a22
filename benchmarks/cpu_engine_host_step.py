"""The engine's host work per decode step at wide batches, measured on the CPU with a model
so small (one layer, 64 wide) that its forward pass is a small part of the step: what the
scheduler, the KV-cache manager, the runner's input building, sampling and the token
bookkeeping (detokenizing, stop checks) cost per step, which on a GPU the device waits
for when it exceeds the step's kernels. Overlapped scheduling (the GPU's decode path) is
forced on, and off; 128-token prompts, 128 greedy tokens each, with a tokenizer.

    PYTHONPATH=. python benchmarks/cpu_engine_host_step.py [--batch-sizes 64,256] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvserve import LLM, SamplingParams
from tests.conftest import save_tokenizer

NEW_TOKENS = 128


def tiny_model_dir() -> str:
    directory = tempfile.mkdtemp()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048)
    LlamaForCausalLM(config).save_pretrained(directory)
    save_tokenizer(directory, config.vocab_size)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="64,256", help="Comma-separated numbers of sequences.")
    parser.add_argument("--rounds", type=int, default=3, help="Timed generate() calls per variant (median).")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model_dir = tiny_model_dir()
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for overlap in (True, False):
        llm = LLM(model=model_dir, device="cpu", dtype="float32", compile_decode=False, max_num_seqs=256,
                  kv_cache_memory="256MiB", overlap_scheduling=overlap, enable_prefix_caching=True)
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            prompts = [{"prompt_token_ids": [(7 * i + j) % 500 + 3 for j in range(128)]} for i in range(batch)]
            llm.generate(prompts[:4], params, use_tqdm=False)
            times = []
            for _ in range(args.rounds):
                start = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                times.append(time.perf_counter() - start)
            step_ms = statistics.median(times) / NEW_TOKENS * 1e3
            print(f"overlap {'on ' if overlap else 'off'} {batch:4d} sequences: {step_ms:6.2f} ms a step "
                  f"({step_ms / batch * 1e3:5.1f} us a sequence), rounds {', '.join(f'{t:.2f}' for t in times)} s",
                  flush=True)
        del llm


if __name__ == "__main__":
    main()
