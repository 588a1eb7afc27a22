"""Whether compiled decode graphs keep greedy output batch-invariant: a short request run
alone (every decode step a compiled graph) against the same request beside a 300-token
prompt (its decode steps that share a step with the prompt's pieces run eager). Prints the
output positions whose logprobs differ. argv[1]: compile_decode (1/0).

    PYTHONPATH=. python benchmarks/results/batch-invariance/compiled_vs_eager_decode.py 1
"""

from __future__ import annotations

import sys

from kvserve import LLM, SamplingParams
from kvserve.engine.core import load_engine_model
from kvserve.engine.engine_args import EngineArgs

compile_decode = sys.argv[1] == "1"
loaded = load_engine_model(EngineArgs(quantization="auto", batch_invariant=True))
llm = LLM(loaded=loaded, quantization="auto", batch_invariant=True, max_num_batched_tokens=64, max_num_seqs=8,
          kv_cache_memory="64MiB", max_model_len=1024, compile_decode=compile_decode, enable_prefix_caching=False)
tokenizer = loaded.tokenizer
short = {"prompt_token_ids": tokenizer.encode("Winter is")}
long = {"prompt_token_ids": tokenizer.encode("The history of the lighthouse begins with fires lit on hilltops. " * 30)[:300]}
params = SamplingParams(temperature=0, max_tokens=24, logprobs=1, ignore_eos=True)
alone = llm.generate([short], params)[0].outputs[0]
beside = llm.generate([short, long], [params, SamplingParams(temperature=0, max_tokens=2)])[0].outputs[0]
print(f"compile_decode={compile_decode}: tokens equal {alone.token_ids == beside.token_ids}; logprobs differ at "
      f"{[i for i, (a, b) in enumerate(zip(alone.logprobs, beside.logprobs)) if a != b]}")
