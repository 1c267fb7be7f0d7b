#!/usr/bin/env bash
# Idempotent set-up for a fresh Debian machine: apt packages, .venv, pip installs.
# Re-running it is quick: each step is skipped when already done.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(fuse3 pkg-config fio redis-server)
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

# vLLM's own filesystem KV tier for tests/test_vllm_tier.py and bench.py's vLLM group: three
# files of the pinned wheel, unpacked unchanged into .venv/vllm-tier (tests/vllm_tier.py
# loads them). The wheel (336 MB) is fetched once into a cache outside the clone. Outside the
# stamp above, so that machines set up before get it too.
VLLM_VERSION=0.33.0
VLLM_FILES=(vllm/v1/kv_offload/tiering/fs/io.py vllm/v1/kv_offload/tiering/fs/thread_pool.py
    vllm/v1/kv_offload/file_mapper.py)
if [[ ! -d .venv/vllm-tier ]]; then
    wheels="${XDG_CACHE_HOME:-$HOME/.cache}/kvfs/vllm"
    find_wheel() { compgen -G "$wheels/vllm-$VLLM_VERSION-*.whl" | head -n1 || true; }
    wheel=$(find_wheel)
    if [[ -z $wheel ]]; then
        echo "setup: fetching the vLLM $VLLM_VERSION wheel (336 MB, once) into $wheels"
        $PY -m pip download -q --no-deps --only-binary=:all: -d "$wheels" "vllm==$VLLM_VERSION" \
            || true
        wheel=$(find_wheel)
    fi
    if [[ -n $wheel ]]; then
        rm -rf .venv/vllm-tier.part
        $PY -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2], sys.argv[3:])' \
            "$wheel" .venv/vllm-tier.part "${VLLM_FILES[@]}"
        mv .venv/vllm-tier.part .venv/vllm-tier
    else
        echo "setup: vLLM $VLLM_VERSION's wheel is unavailable: tests/test_vllm_tier.py skips"
    fi
fi
