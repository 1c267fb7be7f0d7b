#!/usr/bin/env bash
# FUSE passthrough and FUSE over io_uring for kvfs: build libfuse 3.18 (Debian sid's source
# package, checksums pinned below; io_uring where liburing-dev and libnuma-dev are installed)
# into .venv/libfuse and install pyfuse3 3.5.0 with kvfs's patch
# (scripts/pyfuse3-passthrough.patch: passthrough, io_uring queues, /dev/fuse polling, a
# reply thread),
# linked against it, into .venv. The system's libfuse and apt sources are left alone.
# Idempotent; exits non-zero on any failure (setup.sh then installs stock pyfuse3 and kvfs
# serves every byte itself, over /dev/fuse).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
PY="$REPO/.venv/bin/python"
PREFIX="$PWD/.venv/libfuse"
WORK="$PWD/.venv/passthrough-build"
FUSE_VERSION=3.18.3
FUSE_DEBIAN=3.18.3-1
PYFUSE3_VERSION=3.5.0
SUMS="bcd19582c5e30f7fe45dd86a5540e998590aa01903afc7ebcbeea6c8ac5421ee  fuse3_${FUSE_VERSION}.orig.tar.gz
c562192287e9ab78656e3ba1faf2cf837cbb0b775f62b97ba1f9993e7eb596e4  fuse3_${FUSE_DEBIAN}.debian.tar.xz
88399a9494b88603230bba300f4ba9ad63fece5ed514ca3633d555a0c6a42b24  pyfuse3-${PYFUSE3_VERSION}.tar.gz"

mkdir -p "$WORK"
cd "$WORK"

# 1. Sources, through a private apt configuration (deb-src of sid) and pip.
if ! sha256sum --quiet -c <<<"$SUMS" >/dev/null 2>&1; then
    mkdir -p apt/parts apt/lists/partial apt/cache
    printf 'Types: deb-src\nURIs: http://deb.debian.org/debian\nSuites: sid\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
        >apt/parts/sid-src.sources
    APT=(-o Dir::Etc::sourcelist=/dev/null -o "Dir::Etc::sourceparts=$WORK/apt/parts"
         -o "Dir::State::Lists=$WORK/apt/lists" -o "Dir::Cache=$WORK/apt/cache")
    apt-get "${APT[@]}" update -qq
    apt-get "${APT[@]}" source --download-only -qq "fuse3=$FUSE_DEBIAN" 2>/dev/null
    "$PY" -m pip download -q --no-deps --no-binary pyfuse3 \
        "pyfuse3==$PYFUSE3_VERSION" -d . 2>/dev/null
    sha256sum --quiet -c <<<"$SUMS"
fi

# 2. libfuse into the private prefix (Debian's patches, in series order).
LIBDIR="$PREFIX/lib/$(gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)"
LIBFUSE_PATCH="$REPO/scripts/libfuse-uring-submit.patch"  # kvfs's fix, see the patch
# custom I/O: pyfuse3's reply thread hooks libfuse's writes to the session's own /dev/fuse fd
MESON_OPTIONS=(-Dexamples=false -Dutils=false -Dtests=false -Dinitscriptdir=
               "-Dudevrulesdir=$PREFIX/udev" -Duseroot=false -Denable-custom-io=true)
LIBFUSE_PATCHED="$WORK/libfuse-patched.sha256"  # the patch and options libfuse was built with
LIBFUSE_BUILD="$( (cat "$LIBFUSE_PATCH"; echo "${MESON_OPTIONS[*]}") | sha256sum)"
if [[ ! -e "$LIBDIR/libfuse3.so.$FUSE_VERSION" ||
        "$(cat "$LIBFUSE_PATCHED" 2>/dev/null)" != "$LIBFUSE_BUILD" ]]; then
    rm -rf "fuse-$FUSE_VERSION" debian
    tar xzf "fuse3_${FUSE_VERSION}.orig.tar.gz"
    tar xJf "fuse3_${FUSE_DEBIAN}.debian.tar.xz"
    if [[ -e debian/patches/series ]]; then
        while read -r patch; do
            [[ -z $patch || $patch == \#* ]] || patch -d "fuse-$FUSE_VERSION" -p1 -s <"debian/patches/$patch"
        done <debian/patches/series
    fi
    patch -d "fuse-$FUSE_VERSION" -p1 -s <"$LIBFUSE_PATCH"
    "$PY" -m pip install -q meson ninja
    export PATH="$REPO/.venv/bin:$PATH"
    meson setup "fuse-$FUSE_VERSION/build" "fuse-$FUSE_VERSION" --prefix="$PREFIX" \
        --libdir="$LIBDIR" "${MESON_OPTIONS[@]}" >meson.log 2>&1
    ninja -C "fuse-$FUSE_VERSION/build" install >ninja.log 2>&1
    echo "$LIBFUSE_BUILD" >"$LIBFUSE_PATCHED"
fi

# 3. pyfuse3 with the passthrough patch, against that libfuse (rpath: no system change).
cd "$REPO"
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
