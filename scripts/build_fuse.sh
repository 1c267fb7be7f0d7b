#!/usr/bin/env bash
# kvfs's FUSE stack: libfuse >= 3.17 (the system's where it ships one, else Debian stable's
# source package, fetched through this machine's own apt sources and checked by apt's
# signatures) built into .venv/libfuse, and kvfs's pyfuse3 fork (vendor/pyfuse3) built
# against it into .venv. The system's libfuse and apt sources are left alone. Idempotent.
# Fails (non-zero, one line on stderr naming the cause and the fix) where it cannot build.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
PY="$REPO/.venv/bin/python"
PREFIX="$REPO/.venv/libfuse"
WORK="$REPO/.venv/fuse-build"
STABLE=trixie  # Debian 13: libfuse 3.17
LOG="$WORK/build.log"
mkdir -p "$WORK"
: >"$LOG"

fail() {
    echo "build_fuse: $1 (log: $LOG)" >&2
    exit 1
}

# 1. libfuse >= 3.17: the system's, or Debian stable's source package.
if pkg-config --atleast-version=3.17 fuse3 2>/dev/null; then
    FUSE_PKGCONFIG="$(pkg-config --variable=pcfiledir fuse3)"
    FUSE_LIBDIR="$(pkg-config --variable=libdir fuse3)"
    FUSE_VERSION="$(pkg-config --modversion fuse3)"
else
    FUSE_LIBDIR="$PREFIX/lib/$(gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)"
    FUSE_PKGCONFIG="$FUSE_LIBDIR/pkgconfig"
    if ! PKG_CONFIG_PATH="$FUSE_PKGCONFIG" pkg-config --atleast-version=3.17 fuse3 2>/dev/null
    then
        # deb-src lines for Debian stable from the Debian archives this machine's apt uses
        # (their URIs and keyrings), in a private apt configuration.
        APT_DIR="$WORK/apt"
        rm -rf "$APT_DIR" "$WORK/src"
        mkdir -p "$APT_DIR/parts" "$APT_DIR/lists/partial" "$APT_DIR/cache" "$WORK/src"
        "$PY" "$REPO/scripts/debian_sources.py" "$STABLE" >"$APT_DIR/parts/stable-src.sources" \
            2>>"$LOG" || fail "no Debian archive in this machine's apt sources: add one, or install libfuse >= 3.17 (pkg-config fuse3)"
        APT=(-o Dir::Etc::sourcelist=/dev/null -o "Dir::Etc::sourceparts=$APT_DIR/parts"
             -o "Dir::State::Lists=$APT_DIR/lists" -o "Dir::Cache=$APT_DIR/cache")
        apt-get "${APT[@]}" update >>"$LOG" 2>&1 \
            || fail "apt-get update of Debian $STABLE's sources failed: check the network and apt's keyring"
        (cd "$WORK/src" && apt-get "${APT[@]}" source --download-only fuse3) >>"$LOG" 2>&1 \
            || fail "apt-get source fuse3 (Debian $STABLE) failed"
        ORIG="$(compgen -G "$WORK/src/fuse3_*.orig.tar.[gx]z" | head -n1)"
        DEBIAN="$(compgen -G "$WORK/src/fuse3_*.debian.tar.[gx]z" | head -n1)"
        [[ -n $ORIG && -n $DEBIAN ]] || fail "Debian $STABLE's fuse3 source is incomplete"
        mkdir -p "$WORK/src/fuse"
        {
            tar xf "$ORIG" -C "$WORK/src/fuse" --strip-components=1
            tar xf "$DEBIAN" -C "$WORK/src/fuse"
            if [[ -e "$WORK/src/fuse/debian/patches/series" ]]; then
                while read -r patch; do
                    [[ -z $patch || $patch == \#* ]] \
                        || patch -d "$WORK/src/fuse" -p1 -s <"$WORK/src/fuse/debian/patches/$patch"
                done <"$WORK/src/fuse/debian/patches/series"
            fi
        } >>"$LOG" 2>&1 || fail "unpacking Debian $STABLE's fuse3 source failed"
        "$PY" -m pip install -q meson ninja >>"$LOG" 2>&1 || fail "pip install meson ninja failed"
        (
            export PATH="$REPO/.venv/bin:$PATH"
            meson setup "$WORK/src/fuse/build" "$WORK/src/fuse" --prefix="$PREFIX" \
                --libdir="$FUSE_LIBDIR" -Dexamples=false -Dutils=false -Dtests=false \
                -Dinitscriptdir= "-Dudevrulesdir=$PREFIX/udev" -Duseroot=false
            ninja -C "$WORK/src/fuse/build" install
        ) >>"$LOG" 2>&1 || fail "building libfuse from Debian $STABLE's source failed"
    fi
    FUSE_VERSION="$(PKG_CONFIG_PATH="$FUSE_PKGCONFIG" pkg-config --modversion fuse3)"
fi

# 2. kvfs's pyfuse3 fork against it (rpath: no system change), rebuilt when its source or
# the libfuse under it changes.
WANT="$( (find vendor/pyfuse3 -type f -not -name '*.c' -print0 | sort -z | xargs -0 cat;
          echo "$FUSE_LIBDIR $FUSE_VERSION") | sha256sum | cut -d' ' -f1)"
STAMP="$WORK/pyfuse3.sha256"
if [[ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]] \
        || ! "$PY" -c "import pyfuse3; pyfuse3.passthrough_enabled" >/dev/null 2>&1; then
    rm -rf "$WORK/pyfuse3" && cp -r vendor/pyfuse3 "$WORK/pyfuse3"
    PKG_CONFIG_PATH="$FUSE_PKGCONFIG" LDFLAGS="-Wl,-rpath,$FUSE_LIBDIR" \
        "$PY" -m pip install -q --force-reinstall --no-deps "$WORK/pyfuse3" >>"$LOG" 2>&1 \
        || fail "building vendor/pyfuse3 against libfuse $FUSE_VERSION failed"
    echo "$WANT" >"$STAMP"
fi
"$PY" -c "from importlib.metadata import version; assert '+kvfs.' in version('pyfuse3')" \
    >>"$LOG" 2>&1 || fail "the pyfuse3 installed is not kvfs's fork"
echo "build_fuse: libfuse $FUSE_VERSION ($FUSE_LIBDIR), pyfuse3 $("$PY" -c \
    'from importlib.metadata import version; print(version("pyfuse3"))')"
