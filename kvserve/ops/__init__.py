"""kvserve's kernels (Triton and C++) and their launch configurations: paged attention and
the KV-cache write (attention/), RMSNorm, RoPE and SwiGLU (elementwise), the weight-only and
fp8 matmuls (quant/), argmax, programmatic dependent launch (pdl), what launches ask of the
device (device) and the C++ CPU kernels (cpu/).

A leaf: modules here import torch, triton, numpy, the standard library and each other, and
of the rest of kvserve only kvserve.envs (plain data); layers, attention backends,
quantization methods and the sampler call them (tests/test_import_rule.py). Nothing is
imported here, so that `import kvserve.ops.<module>` loads that module alone (CPU-only paths
do not pull in Triton).
"""
