#!/usr/bin/env bash
# Sets everything up, then runs the default test suite (slow and GPU tests excluded;
# run them with: python3 -m pytest -m slow / -m gpu).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec "${PYTHON:-python3}" -m pytest -q "$@"
