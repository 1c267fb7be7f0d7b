#!/usr/bin/env bash
# FUSE passthrough for kvfs: build libfuse 3.17 (Debian trixie's source package, through
# scripts/build_libfuse.sh) into .venv/libfuse and install pyfuse3 3.5.0 with kvfs's
# passthrough patch (scripts/pyfuse3-passthrough.patch), linked against it, into .venv. The
# system's libfuse and apt sources are left alone. Idempotent; exits non-zero on any failure
# (setup.sh then installs stock pyfuse3 and kvfs serves every byte itself).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
PY="$REPO/.venv/bin/python"
PREFIX="$PWD/.venv/libfuse"
WORK="$PWD/.venv/passthrough-build"
PYFUSE3_VERSION=3.5.0
SUMS="88399a9494b88603230bba300f4ba9ad63fece5ed514ca3633d555a0c6a42b24  pyfuse3-${PYFUSE3_VERSION}.tar.gz"

# 1. pyfuse3's source, checked against its pinned checksum.
mkdir -p "$WORK"
cd "$WORK"
if ! sha256sum --quiet -c <<<"$SUMS" >/dev/null 2>&1; then
    "$PY" -m pip download -q --no-deps --no-binary pyfuse3 \
        "pyfuse3==$PYFUSE3_VERSION" -d . 2>/dev/null
    sha256sum --quiet -c <<<"$SUMS"
fi

# 2. libfuse into the private prefix.
cd "$REPO"
bash scripts/build_libfuse.sh trixie 3.17.2-3 "$PREFIX"
LIBDIR="$PREFIX/lib/$(gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)"

# 3. pyfuse3 with the passthrough patch, against that libfuse (rpath: no system change).
PATCHED="$WORK/pyfuse3-patched.sha256"  # the patch pyfuse3 was last built with
if [[ "$(cat "$PATCHED" 2>/dev/null)" != "$(sha256sum <scripts/pyfuse3-passthrough.patch)" ]] ||
        ! "$PY" -c "import pyfuse3; pyfuse3.passthrough_enabled" 2>/dev/null; then
    rm -rf "$WORK/pyfuse3-$PYFUSE3_VERSION"
    tar xzf "$WORK/pyfuse3-$PYFUSE3_VERSION.tar.gz" -C "$WORK"
    patch -d "$WORK/pyfuse3-$PYFUSE3_VERSION" -p1 -s <scripts/pyfuse3-passthrough.patch
    rm -f "$WORK/pyfuse3-$PYFUSE3_VERSION/src/pyfuse3/__init__.c"  # generated: rebuild it
    PKG_CONFIG_PATH="$LIBDIR/pkgconfig" LDFLAGS="-Wl,-rpath,$LIBDIR" \
        "$PY" -m pip install -q --force-reinstall "$WORK/pyfuse3-$PYFUSE3_VERSION"
    sha256sum <scripts/pyfuse3-passthrough.patch >"$PATCHED"
fi
"$PY" -c "import pyfuse3; assert pyfuse3.passthrough_enabled() is False"
