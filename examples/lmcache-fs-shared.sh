#!/usr/bin/env bash
# One vLLM instance that shares KV cache with every other instance through kvfs.
# Run the same on each instance (change only the port and GPU); the mount comes first:
#   python mount_kvfs.py /mnt/kvfs --data /mnt/nvmeof/kvpool --capacity 2T
set -euo pipefail
mkdir -p /mnt/kvfs/lmcache

export PYTHONHASHSEED=0                      # identical on every instance: vLLM seeds its
                                             # prefix-hash chain from it
export LMCACHE_CONFIG_FILE="$(dirname "$(realpath "$0")")/lmcache-fs-shared.yaml"
export LMCACHE_TRACK_USAGE=false             # no usage telemetry
export LMCACHE_LOG_LEVEL=INFO                # "Retrieved N out of M required tokens" per request

exec vllm serve meta-llama/Llama-3.1-8B-Instruct \
    --port "${PORT:-8000}" \
    --tensor-parallel-size 1 \
    --dtype float16 \
    --kv-transfer-config '{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}'
