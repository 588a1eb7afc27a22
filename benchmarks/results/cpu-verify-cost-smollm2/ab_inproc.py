"""In-process A/B: decode step vs verify step (1+4) through the new decode-row path and
the old prefill path, plus greedy verification sampling new vs old; interleaved, medians."""
import statistics, sys, time, torch
from kvserve.llm import LLM
from kvserve.attention import torch_ref
from kvserve.benchmarks.verify_cost import CpuStep
from kvserve.sample.sampler import SamplingRow, final_probs
from kvserve.sampling_params import SamplingParams
from kvserve.spec_decode.rejection_sampler import DraftVerification, rejection_sample
from kvserve.spec_decode.speculator import Speculator
from kvserve.spec_decode.config import SpeculativeConfig
from kvserve.spec_decode.proposer import DraftContext
from kvserve.spec_decode.ngram_proposer import NgramProposer
compile_decode = len(sys.argv) > 1 and sys.argv[1] == "compiled"
llm = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4}, compile_decode=compile_decode)
decode, verify = CpuStep(llm, 1, 300), CpuStep(llm, 5, 300)
new_limit = torch_ref.SHORT_QUERY_MAX_ROWS
def verify_old():
    torch_ref.SHORT_QUERY_MAX_ROWS = 0
    try:
        return verify.run()
    finally:
        torch_ref.SHORT_QUERY_MAX_ROWS = new_limit
runner = llm.engine.core.runner
V = llm.engine.model_config.vocab_size
logits = torch.randn(5, V)
params = SamplingParams(temperature=0.0)
spec = Speculator(SpeculativeConfig("ngram", 4), NgramProposer(4, 2), 2048)
ctx = DraftContext("s", list(range(300)), 250, params, 400, None)
drafts = [1, 2, 3, 4]
def sample_new():
    t = time.perf_counter(); spec.verify(logits, [ctx], [drafts], [0]); return (time.perf_counter() - t) * 1e3, False
def sample_old():
    t = time.perf_counter()
    rows = [SamplingRow(params, ctx.prompt_token_ids, ctx.output_token_ids + drafts[:j], None, [0]) for j in range(5)]
    rejection_sample(final_probs(logits, rows), [DraftVerification(drafts, None, None)])
    return (time.perf_counter() - t) * 1e3, False
cases = {"decode": decode.run, "verify_new": verify.run, "verify_old": verify_old,
         "sample_new": sample_new, "sample_old": sample_old}
for f in cases.values(): f()
times = {k: [] for k in cases}; compiled = {k: True for k in cases}
names = list(cases)
for i in range(int(sys.argv[2]) if len(sys.argv) > 2 else 30):
    for name in (names if i % 2 == 0 else names[::-1]):
        ms, c = cases[name](); times[name].append(ms); compiled[name] &= c
med = {k: statistics.median(v) for k, v in times.items()}
print(f"threads={torch.get_num_threads()} compile_decode={compile_decode} " + " ".join(f"{k}={v:.2f}ms" for k, v in med.items()))
print(f"compiled graph ran: decode={compiled['decode']} verify_new={compiled['verify_new']}")
print(f"step ratio (forward+head+argmax): new {med['verify_new']/med['decode']:.3f}x, old {med['verify_old']/med['decode']:.3f}x; "
      f"with verification sampling: new {(med['verify_new']+med['sample_new'])/med['decode']:.3f}x, "
      f"old {(med['verify_old']+med['sample_old'])/med['decode']:.3f}x")
