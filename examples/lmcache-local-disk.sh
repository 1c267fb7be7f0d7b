#!/usr/bin/env bash
# One vLLM instance with a private LMCache local_disk tier on a kvfs mount. Instances do not
# share through local_disk in LMCache 0.5.6: give each its own INSTANCE number (directory).
set -euo pipefail
INSTANCE="${INSTANCE:-0}"
mkdir -p "/mnt/kvfs/local-disk/instance-$INSTANCE"

config="$(mktemp --suffix=.yaml)"
sed "s#/local-disk/instance-0/#/local-disk/instance-$INSTANCE/#" \
    "$(dirname "$(realpath "$0")")/lmcache-local-disk.yaml" >"$config"

export PYTHONHASHSEED=0
export LMCACHE_CONFIG_FILE="$config"
export LMCACHE_TRACK_USAGE=false
export LMCACHE_LOG_LEVEL=INFO

exec vllm serve meta-llama/Llama-3.1-8B-Instruct \
    --port "$((8000 + INSTANCE))" \
    --tensor-parallel-size 1 \
    --dtype float16 \
    --kv-transfer-config '{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}'
