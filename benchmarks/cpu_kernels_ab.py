"""kvserve's C++ decode matmuls (kvserve/ops/cpu/csrc/decode_matmul.cpp) in this tree against the
same file at a git revision, in one process with their timings interleaved (the machine is
shared and noisy): the revision's source is built under another op namespace beside this
tree's build. `--rows` rows of x (a decode batch) against SmolLM2's int4 g32 linears and
int8 LM head shapes; each pair of outputs must be equal bit for bit (a change meant to be
faster, not different), or with `--summation-order` agree to fp32 rounding.

    python benchmarks/cpu_kernels_ab.py --base HEAD~1 [--repeats 7] [--rows 1]

With `--decode-rounds N`, whole decode steps instead: two engines on the embedded SmolLM2
(`auto`, the compiled decode step), one with this tree's int4 kernel (and scales) and one with
the base's kernel on fp32 scales,
N interleaved rounds of 64 greedy tokens at `--rows` sequences (the tokens must agree).
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

from kvserve.ops.cpu import int4_matmul_op, int8_matmul_op

SOURCE = "kvserve/ops/cpu/csrc/decode_matmul.cpp"
# Its path at revisions from before the kernels moved to kvserve/ops.
OLD_SOURCE = "kvserve/cpu_kernels/csrc/decode_matmul.cpp"
INT4_SHAPES = [(960, 576), (3072, 576), (576, 1536), (49152, 576)]
INT8_SHAPES = [(49152, 576), (3072, 576)]


def build_base(revision: str) -> object:
    """The revision's ops, registered as torch.ops.kvserve_cpu_base."""
    shown = [subprocess.run(["git", "show", f"{revision}:{path}"], capture_output=True, text=True)
             for path in (SOURCE, OLD_SOURCE)]
    text = next((show.stdout for show in shown if show.returncode == 0), None)
    if text is None:
        raise SystemExit(f"{revision} has neither {SOURCE} nor {OLD_SOURCE}")
    source = Path(tempfile.mkdtemp()) / "decode_matmul_base.cpp"
    source.write_text(text.replace("kvserve_cpu", "kvserve_cpu_base"))
    cpp_extension.load(name="kvserve_cpu_ab_base", sources=[str(source)], extra_cflags=["-O3", "-march=native", "-fopenmp"],
                       extra_ldflags=["-fopenmp"], is_python_module=False)
    return torch.ops.kvserve_cpu_base


def seconds_per_call(fn, calls: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def decode_steps(base: object, batch: int, rounds: int) -> None:
    """Median ms a decode step of an engine on this tree's int4 kernel and of one on the base's."""
    import statistics

    from kvserve.benchmarks.cpu_decode import DecodeStepTimer, run_round
    from kvserve.llm import LLM
    from kvserve.ops.cpu import _int4_matmul_shape
    from kvserve.quantization import int4

    torch.library.register_fake("kvserve_cpu_base::int4_matmul")(_int4_matmul_shape)
    engines = {}
    for name, op in (("this", int4.int4_matmul_op), ("base", lambda: base.int4_matmul)):
        # Int4Linear takes its kernel when built. Kernels before 2f18f06 take fp32 scales only,
        # so the base's engine keeps fp32 ones (this tree's keeps fp16 where they are exact).
        kept = int4.int4_matmul_op, int4.exact_in_fp16
        int4.int4_matmul_op = op
        if name == "base":
            int4.exact_in_fp16 = lambda values: False
        try:
            llm = LLM(quantization="auto", compile_decode=True, enable_prefix_caching=False)
        finally:
            int4.int4_matmul_op, int4.exact_in_fp16 = kept
        engines[name] = llm, DecodeStepTimer(llm)
    ms: dict[str, list[float]] = {name: [] for name in engines}
    for round_index in range(rounds):
        tokens = {}
        for name in (list(engines) if round_index % 2 == 0 else list(engines)[::-1]):
            step_ms, tokens[name] = run_round(*engines[name], batch, 64, 64, seed=round_index)
            ms[name].append(step_ms)
        assert tokens["this"] == tokens["base"], "the two kernels' engines decoded different tokens"
        print(f"round {round_index}: this {ms['this'][-1]:.2f} ms, base {ms['base'][-1]:.2f} ms", flush=True)
    this, base_ms = statistics.median(ms["this"]), statistics.median(ms["base"])
    print(f"batch {batch}, median ms a decode step over {rounds} interleaved rounds: this {this:.2f}, "
          f"base {base_ms:.2f} ({base_ms / this:.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="Git revision whose kernel source is the baseline (required).")
    parser.add_argument("--repeats", type=int, default=7,
                        help="Interleaved timings per shape; the median is kept (default: 7).")
    parser.add_argument("--rows", type=int, default=1, help="Rows of x (decode sequences) a call (default: 1).")
    parser.add_argument("--decode-rounds", type=int, default=0,
                        help="If > 0, time this many rounds of whole decode steps of two engines (this tree's "
                             "int4 kernel, the base's) instead of the kernels alone (default: 0).")
    parser.add_argument("--summation-order", action="store_true",
                        help="The change sums in another order: outputs must agree to 1e-5 of the largest, "
                             "not bit for bit.")
    args = parser.parse_args()
    base = build_base(args.base)
    if args.decode_rounds:
        decode_steps(base, args.rows, args.decode_rounds)
        return
    this4, this8 = int4_matmul_op(), int8_matmul_op()
    torch.manual_seed(0)
    cases = []
    for n, k in INT4_SHAPES:
        x, q = torch.randn(args.rows, k), torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
        scale, minimum = torch.rand(n, k // 32), torch.rand(n, k // 32)
        cases.append((f"int4 g32 {n}x{k}", lambda x=x, q=q, s=scale, m=minimum: this4(x, q, s, m, 32),
                      lambda x=x, q=q, s=scale, m=minimum: base.int4_matmul(x, q, s, m, 32), 100))
    for n, k in INT8_SHAPES:
        x, q, scale = torch.randn(args.rows, k), torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n)
        cases.append((f"int8 {n}x{k}", lambda x=x, q=q, s=scale: this8(x, q, s),
                      lambda x=x, q=q, s=scale: base.int8_matmul(x, q, s), 30))
    print(f"{args.rows} row(s) of x, us a call, median of {args.repeats} interleaved timings; base = {args.base}")
    for name, this, baseline, calls in cases:
        y, y_base = this(), baseline()
        if args.summation_order:
            error = ((y - y_base).abs().max() / y_base.abs().max()).item()
            assert error <= 1e-5, f"{name}: outputs differ from the base revision's by {error:.1e} of the largest"
        else:
            assert torch.equal(y, y_base), f"{name}: outputs differ from the base revision's"
        times = [(seconds_per_call(this, calls), seconds_per_call(baseline, calls)) for _ in range(args.repeats)]
        this_us = sorted(t for t, _ in times)[args.repeats // 2] * 1e6
        base_us = sorted(b for _, b in times)[args.repeats // 2] * 1e6
        print(f"{name:>18}: this {this_us:8.1f}  base {base_us:8.1f}  ({base_us / this_us:.2f}x)")


if __name__ == "__main__":
    main()
