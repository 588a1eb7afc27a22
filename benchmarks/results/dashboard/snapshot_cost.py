import time, statistics
from kvserve import LLM, SamplingParams
llm = LLM(kv_cache_memory="256MiB", max_model_len=1024, quantization="none", compile_decode=False)
engine = llm.engine
core = engine.core
times = []
def on_step():
    t = time.perf_counter(); engine.dashboard_snapshot(); times.append(time.perf_counter() - t)
params = SamplingParams(max_tokens=32, ignore_eos=True, temperature=0)
prompts = [{"prompt_token_ids": list(range(1000 + 100 * i, 1040 + 100 * i))} for i in range(16)]
llm.generate(prompts, params, on_step=on_step)
print(f"snapshot with 16 running sequences, {core.runner.num_blocks} blocks: median {statistics.median(times)*1e3:.3f} ms, max {max(times)*1e3:.3f} ms over {len(times)} steps")
# per-step timeline record cost
from kvserve.engine.step_timeline import StepTimeline
tl = StepTimeline(); tl.watch()
seqs = list(core.scheduler.seqs.values())
class S:  # stand-ins shaped like 256 decoding sequences
    num_tokens = 100; num_computed_tokens = 99
fake = [(S(), 1)] * 256
t = time.perf_counter()
for _ in range(1000):
    tl.record(iter(fake), 0)
print(f"timeline record of a 256-sequence step: {(time.perf_counter() - t) / 1000 * 1e6:.1f} us")
