"""Where the Qwen2.5-VL-7B vision tower's time goes on one GPU: kvserve's pass over one
1024x1024 image (random weights, bf16), timed whole and under torch.profiler (top ops by
device time, and the host time of the pass).

    PYTHONPATH=. python benchmarks/gpu_vision_profile.py [--image-size 1024]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from PIL import Image
from transformers import Qwen2_5_VLConfig, Qwen2VLImageProcessor
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

from kvserve.model_executor.dummy import _QWEN2_5_VL_7B_HF_CONFIG
from kvserve.model_executor.models import qwen_vision_slices


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--image-size", type=int, default=1024, help="Square image side in pixels.")
    args = parser.parse_args()
    config = Qwen2_5_VLConfig(**_QWEN2_5_VL_7B_HF_CONFIG).vision_config
    with torch.device("cuda"):
        visual = Qwen2_5_VisionTransformerPretrainedModel._from_config(config, dtype=torch.bfloat16).eval()
    pixels = np.random.default_rng(0).integers(0, 256, (args.image_size, args.image_size, 3), dtype=np.uint8)
    processor = Qwen2VLImageProcessor()
    start = time.perf_counter()
    inputs = processor(images=[Image.fromarray(pixels)], return_tensors="pt")
    print(f"image processor: {1e3 * (time.perf_counter() - start):.1f} ms, {inputs['pixel_values'].shape[0]} patches")

    def encode() -> None:
        state = qwen_vision_slices.begin(visual, inputs["pixel_values"].cuda().bfloat16(),
                                         inputs["image_grid_thw"].cuda())
        qwen_vision_slices.advance(visual, state, state.total_units)
        qwen_vision_slices.result(state)

    with torch.inference_mode():
        for _ in range(3):
            encode()
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            start = time.perf_counter()
            encode()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        print(f"tower: {1e3 * sorted(times)[2]:.1f} ms median of 5")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            encode()
            torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15, max_name_column_width=60))


if __name__ == "__main__":
    main()
