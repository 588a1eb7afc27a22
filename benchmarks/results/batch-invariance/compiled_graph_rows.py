"""Whether the compiled decode graphs alone are batch-invariant (every decode step of these
runs compiled: no prompt rows share a decode step, at most 16 rows): a short request alone
(the 1-row graph) against the same request beside 3 requests of its length and beside 3
requests with 150-token prompts (the 2-16-row graph; longer cached contexts pad its
attention; the four prompts fit one step's budget, so no decode step holds prompt rows).
Prints the output positions whose logprobs differ from the solo run's.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/results/batch-invariance/compiled_graph_rows.py
"""

from __future__ import annotations

from kvserve import LLM, SamplingParams
from kvserve.engine.core import load_engine_model
from kvserve.engine.engine_args import EngineArgs

loaded = load_engine_model(EngineArgs(quantization="auto", batch_invariant=True))
llm = LLM(loaded=loaded, quantization="auto", batch_invariant=True, kv_cache_memory="64MiB", max_model_len=1024,
          compile_decode=True, enable_prefix_caching=False)
runner = llm.engine.core.runner
compiled, eager_steps = runner.compiled_decode, [0]
applies = compiled.applies


def counted_applies(metadata) -> bool:
    ok = applies(metadata)
    eager_steps[0] += not ok
    return ok


compiled.applies = counted_applies
tokenizer = loaded.tokenizer
params = SamplingParams(temperature=0, max_tokens=24, logprobs=1, ignore_eos=True)
short = "Winter is"
long_ids = tokenizer.encode("The history of the lighthouse begins with fires lit on hilltops. " * 20)[:150]
runs = {
    "alone": [short],
    "beside 3 of its length": [short, "Coffee is", "Rain is", "Trains are"],
    "beside 3 of 150 tokens": [short] + [{"prompt_token_ids": long_ids[i:] + long_ids[:i]} for i in (0, 1, 2)],
}
reference = None
for name, prompts in runs.items():
    eager_steps[0] = 0
    output = llm.generate(prompts, [params] * len(prompts))[0].outputs[0]
    reference = reference or output
    differ = [i for i, (a, b) in enumerate(zip(reference.logprobs, output.logprobs)) if a != b]
    print(f"{name}: decode steps not compiled {eager_steps[0]}; tokens equal "
          f"{reference.token_ids == output.token_ids}; logprobs differ at {differ}", flush=True)
