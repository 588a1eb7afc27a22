"""The sampler's argmax over llama3's 128,256 fp32 logits: torch.argmax against kvserve's
two Triton kernels (kvserve.sample.argmax), at decode batch sizes. GPU only:
python benchmarks/gpu_argmax.py"""

from __future__ import annotations

import torch
from triton.testing import do_bench

from kvserve.sample.argmax import row_argmax


def main() -> None:
    print(torch.cuda.get_device_name(), "us per call (do_bench median, CUDA graph of 20 calls)")
    for rows in (1, 8, 64, 256):
        logits = torch.randn(rows, 128256, device="cuda")
        assert torch.equal(row_argmax(logits), logits.argmax(dim=-1))
        times = {}
        for name, fn in (("torch.argmax", lambda: logits.argmax(dim=-1)), ("row_argmax", lambda: row_argmax(logits))):
            graph = torch.cuda.CUDAGraph()  # graph replay: the kernels' time, not Python's launches
            with torch.cuda.graph(graph):
                for _ in range(20):
                    fn()
            times[name] = do_bench(graph.replay, warmup=10, rep=100, return_mode="median") * 1e3 / 20
        print(f"rows {rows:4d}: " + "  ".join(f"{name} {us:6.1f}" for name, us in times.items()), flush=True)


if __name__ == "__main__":
    main()
