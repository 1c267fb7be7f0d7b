#!/usr/bin/env bash
# Build one of Debian's libfuse source packages (its patches applied in series order) into a
# private prefix; the system's libfuse and apt sources are left alone:
#
#     scripts/build_libfuse.sh SUITE DEBIAN_VERSION PREFIX
#
# 3.17.2-3 (trixie) is kvfs's, for FUSE passthrough (scripts/build_passthrough.sh);
# 3.18.3-1 (sid) has FUSE over io_uring (scripts/bench_uring.py; built with it only where
# liburing-dev and libnuma-dev are installed). Sources are checked against the checksums
# pinned below. Idempotent; exits non-zero on any failure.
set -euo pipefail
SUITE=$1
DEBIAN=$2
PREFIX=$3
UPSTREAM=${DEBIAN%-*}
cd "$(dirname "$0")/.."
REPO="$PWD"
PY="$REPO/.venv/bin/python"
WORK="$PREFIX-build"
declare -A PINNED=(
    [3.17.2-3]="3d932431ad94e86179e5265cddde1d67aa3bb2fb09a5bd35c641f86f2b5ed06f  fuse3_3.17.2.orig.tar.gz
eaf7a177761ae8bf99ea97619f2cccf83f169b4f000e17b6106834e69456b5a2  fuse3_3.17.2-3.debian.tar.xz"
    [3.18.3-1]="bcd19582c5e30f7fe45dd86a5540e998590aa01903afc7ebcbeea6c8ac5421ee  fuse3_3.18.3.orig.tar.gz
c562192287e9ab78656e3ba1faf2cf837cbb0b775f62b97ba1f9993e7eb596e4  fuse3_3.18.3-1.debian.tar.xz"
)
SUMS=${PINNED[$DEBIAN]:?"no checksums pinned for fuse3 $DEBIAN"}
LIBDIR="$PREFIX/lib/$(gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)"
[[ -e "$LIBDIR/libfuse3.so.$UPSTREAM" ]] && exit 0

mkdir -p "$WORK"
cd "$WORK"
# 1. The source package, through a private apt configuration (deb-src of SUITE).
if ! sha256sum --quiet -c <<<"$SUMS" >/dev/null 2>&1; then
    mkdir -p apt/parts apt/lists/partial apt/cache
    printf 'Types: deb-src\nURIs: http://deb.debian.org/debian\nSuites: %s\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
        "$SUITE" >apt/parts/source.sources
    APT=(-o Dir::Etc::sourcelist=/dev/null -o "Dir::Etc::sourceparts=$WORK/apt/parts"
         -o "Dir::State::Lists=$WORK/apt/lists" -o "Dir::Cache=$WORK/apt/cache")
    apt-get "${APT[@]}" update -qq
    apt-get "${APT[@]}" source --download-only -qq "fuse3=$DEBIAN" 2>/dev/null
    sha256sum --quiet -c <<<"$SUMS"
fi

# 2. Debian's patches, then meson and ninja from .venv.
rm -rf "fuse-$UPSTREAM" debian
tar xzf "fuse3_${UPSTREAM}.orig.tar.gz"
tar xJf "fuse3_${DEBIAN}.debian.tar.xz"
if [[ -e debian/patches/series ]]; then
    while read -r patch; do
        [[ -z $patch || $patch == \#* ]] || patch -d "fuse-$UPSTREAM" -p1 -s <"debian/patches/$patch"
    done <debian/patches/series
fi
"$PY" -m pip install -q meson ninja
export PATH="$REPO/.venv/bin:$PATH"
meson setup "fuse-$UPSTREAM/build" "fuse-$UPSTREAM" --prefix="$PREFIX" \
    --libdir="$LIBDIR" -Dexamples=false -Dutils=false -Dtests=false -Dinitscriptdir= \
    -Dudevrulesdir="$PREFIX/udev" -Duseroot=false >meson.log 2>&1
ninja -C "fuse-$UPSTREAM/build" install >ninja.log 2>&1
