#!/usr/bin/env bash
# Set up (apt packages, .venv, pip installs) and run the whole test suite: lint, then pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/mypy
.venv/bin/python -m pytest -q "$@"
if (($# == 0)); then
    # The path kernels without passthrough take (every byte served by kvfs): the clients and
    # the POSIX suite again, with --passthrough off on every mount.
    KVFS_TEST_MOUNT_OPTIONS="--passthrough off" .venv/bin/python -m pytest -q \
        tests/test_lmcache.py tests/test_vllm_tier.py tests/test_posix.py tests/test_maps.py
fi
