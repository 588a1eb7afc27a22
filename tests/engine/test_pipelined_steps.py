"""The engine core's pipelined steps (pipeline parallelism keeps up to one step per stage in
flight), driven in one process: a runner whose steps run only when their output is asked
for, oldest first, as the stages of a pipeline finish them. Each step is scheduled while the
earlier ones are still unrun; the outputs must equal an engine that runs one step at a time."""

from __future__ import annotations

from collections import deque

from kvserve import LLM, SamplingParams
from kvserve.core.sched.output import ModelRunnerOutput, SchedulerOutput
from tests.distributed.test_tensor_parallel import _save_tiny


class DeferredRunner:
    """A ModelRunner whose submitted steps run when received (in submission order)."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.submitted: deque[SchedulerOutput] = deque()
        self.most_unrun = 0

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    def submit(self, sched: SchedulerOutput) -> None:
        running = {seq_id for step in self.submitted for seq_id in step.num_scheduled_tokens}
        assert not running & set(sched.num_scheduled_tokens), "a sequence in two steps in flight"
        self.submitted.append(sched)
        self.most_unrun = max(self.most_unrun, len(self.submitted))

    def receive(self) -> ModelRunnerOutput:
        return self.runner.execute(self.submitted.popleft())


def test_three_steps_in_flight_give_the_one_at_a_time_outputs(tmp_path_factory):
    model_dir = _save_tiny(tmp_path_factory, num_hidden_layers=2)
    prompts = [{"prompt_token_ids": [(13 * i + j) % 250 for j in range(3 + 7 * i)]} for i in range(6)]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    # A prompt forking into seeded samples: they are in flight from their parent's step on.
    seeded = SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=10, ignore_eos=True)
    kwargs = dict(dtype="float32", kv_cache_memory="4MiB", max_num_batched_tokens=16, overlap_scheduling=False)

    def generate(llm: LLM) -> list[list[list[int]]]:
        outputs = llm.generate(prompts + prompts[1:2], [greedy] * len(prompts) + [seeded])
        return [[sample.token_ids for sample in output.outputs] for output in outputs]

    expected = generate(LLM(model_dir, **kwargs))
    llm = LLM(model_dir, **kwargs)
    core = llm.engine.core
    core.runner = DeferredRunner(core.runner)
    core.max_batches_in_flight = 3
    assert generate(llm) == expected
    assert core.runner.most_unrun == core.most_batches_in_flight == 3
    assert not core.has_unfinished_requests()
