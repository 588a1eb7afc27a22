# Sourced by the one-call device scripts: the repository root as working directory and import
# path, results under $OUT (the device tool's folder), and which GPU this is.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/kvserve-gpu}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
