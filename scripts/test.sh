#!/usr/bin/env bash
# Sets everything up, then runs the default test suite (slow and GPU tests excluded;
# run them with: python3 -m pytest -m slow / -m gpu). Two pytest-xdist workers, whole files
# each (module fixtures load once): they overlap well on 2 cores, since much of a test's time
# is single-threaded Python (servers, engine steps of tiny models). Not loadgroup: pytest 9.2
# ignores the node ids xdist 3.8 rewrites for it, and every test becomes its own unit.
# KVSERVE_TEST_WORKERS=0 runs in one process. The 20 slowest tests are listed at the end, so that
# a run drifting towards its 10-minute budget says where the time went.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec "${PYTHON:-python3}" -m pytest -q -n "${KVSERVE_TEST_WORKERS:-2}" --dist loadfile --durations=20 "$@"
