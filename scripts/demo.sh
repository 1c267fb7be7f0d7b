#!/usr/bin/env bash
# Set up (apt packages, .venv, pip installs) and run the demo: two LMCache instances
# sharing KV cache through one kvfs mount on the embedded default data directory.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python scripts/demo.py "$@"
