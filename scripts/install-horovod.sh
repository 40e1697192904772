#!/usr/bin/env bash
# Install Horovod 0.28.1 (PyTorch + Gloo, no MPI/TensorFlow/MXNet) into the
# current Python, built from the sdist with its C++ standard switched to 17.
#
# Horovod 0.28.1's CMake asks for C++14, but the headers of torch >= 2.1 need
# C++17, so the released sdist does not build against current torch as is.
#
# Needs: python + pip, gcc/g++, make (or ninja; falls back to a pip-installed
# ninja when neither is on PATH), torch already installed. Torch is never
# touched: everything pip installs here is constrained to the installed torch.
#
# Environment:
#   PYTHON                 interpreter to install into (default: python)
#   HOROVOD_BUILD_JOBS     parallel compile jobs (default: nproc)
#   HOROVOD_INSTALL_FORCE  set to 1 to rebuild even if Horovod already works
set -euo pipefail

PY="${PYTHON:-python}"
HVD_VERSION=0.28.1
JOBS="${HOROVOD_BUILD_JOBS:-$(nproc 2>/dev/null || echo 2)}"

log() { printf '[install-horovod] %s\n' "$*"; }
die() { printf '[install-horovod] ERROR: %s\n' "$*" >&2; exit 1; }

# Run import checks from / so a horovod/ folder in the cwd cannot shadow the
# installed package.
CHECK_PY="
import horovod, horovod.torch as hvd
assert horovod.__version__ == '${HVD_VERSION}', horovod.__version__
assert hvd.gloo_built(), 'Horovod was built without gloo'
"
horovod_ok() { (cd / && "$PY" -c "$CHECK_PY") >/dev/null 2>&1; }

# --- 1. idempotency ----------------------------------------------------------
if [[ "${HOROVOD_INSTALL_FORCE:-0}" != 1 ]] && horovod_ok; then
    log "Horovod ${HVD_VERSION} with PyTorch and Gloo is already installed for $("$PY" -c 'import sys; print(sys.executable)'); nothing to do."
    exit 0
fi

command -v "$PY" >/dev/null 2>&1 || die "python interpreter '$PY' not found"
command -v g++ >/dev/null 2>&1 || command -v c++ >/dev/null 2>&1 || die "no C++ compiler (g++) on PATH"
TORCH_VERSION="$(cd / && "$PY" -c 'import torch; print(torch.__version__)')" \
    || die "torch is not importable from '$PY'; install torch first"
log "python: $("$PY" -c 'import sys; print(sys.executable)'), torch ${TORCH_VERSION}, ${JOBS} build jobs"

WORKDIR="$(mktemp -d "${TMPDIR:-/tmp}/install-horovod.XXXXXX")"
cleanup() { rm -rf "$WORKDIR"; }
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Keep pip's hands off torch in every install below.
CONSTRAINTS="$WORKDIR/constraints.txt"
printf 'torch==%s\n' "$TORCH_VERSION" > "$CONSTRAINTS"
pip_install() { "$PY" -m pip install --disable-pip-version-check -c "$CONSTRAINTS" "$@"; }

# --- 2. build deps -----------------------------------------------------------
# cmake<4: Horovod's bundled third-party CMake files (gloo, flatbuffers, ...)
# declare cmake_minimum_required < 3.5, which CMake 4 refuses.
# setuptools/wheel: the build backend (run without build isolation).
# cloudpickle, psutil, pyyaml, packaging, cffi: Horovod's install_requires,
# which setup.py also lists as setup_requires for build actions, so they must
# be present before the build; packaging is also imported by setup.py itself.
log "installing build and runtime dependencies"
pip_install 'cmake<4' setuptools wheel packaging \
    cloudpickle psutil pyyaml 'cffi>=1.4.0'

CMAKE_BIN="$("$PY" -c 'import cmake, os; print(os.path.join(cmake.CMAKE_BIN_DIR, "cmake"))')"
[[ -x "$CMAKE_BIN" ]] || die "pip-installed cmake not found at $CMAKE_BIN"
log "cmake: $CMAKE_BIN ($("$CMAKE_BIN" --version | head -n1))"
export HOROVOD_CMAKE="$CMAKE_BIN"

if ! command -v make >/dev/null 2>&1; then
    if ! command -v ninja >/dev/null 2>&1; then
        log "no make/ninja on PATH; installing ninja from pip"
        pip_install ninja
        NINJA_BIN="$("$PY" -c 'import ninja, os; print(os.path.join(ninja.BIN_DIR, "ninja"))')"
        export PATH="$(dirname "$NINJA_BIN"):$PATH"
    fi
    export CMAKE_GENERATOR=Ninja
    log "using CMake generator Ninja"
fi

# --- fetch + unpack the sdist --------------------------------------------------
log "downloading horovod==${HVD_VERSION} sdist"
"$PY" -m pip download --disable-pip-version-check --no-deps --no-binary :all: \
    --no-build-isolation -d "$WORKDIR/dl" "horovod==${HVD_VERSION}"
SDIST="$(ls "$WORKDIR"/dl/horovod-"${HVD_VERSION}".tar.gz 2>/dev/null)" \
    || die "sdist horovod-${HVD_VERSION}.tar.gz not downloaded"
tar -xzf "$SDIST" -C "$WORKDIR"
SRC="$WORKDIR/horovod-${HVD_VERSION}"
[[ -f "$SRC/setup.py" ]] || die "unexpected sdist layout in $SDIST"

# --- C++14 -> C++17 ------------------------------------------------------------
# Horovod's own CMake files (not the vendored third_party ones) that pin 14.
# Known: CMakeLists.txt (global) and horovod/torch/CMakeLists.txt (re-sets it
# for torch >= 1.5, so the global switch alone is not enough).
mapfile -t STD_FILES < <(cd "$SRC" && grep -rlE 'CMAKE_CXX_STANDARD[[:space:]]+14' \
    --include=CMakeLists.txt --include='*.cmake' . | grep -v '^\./third_party/' | sort)
for required in ./CMakeLists.txt ./horovod/torch/CMakeLists.txt; do
    printf '%s\n' "${STD_FILES[@]}" | grep -qxF "$required" \
        || die "expected 'CMAKE_CXX_STANDARD 14' in $required; sdist changed?"
done
for f in "${STD_FILES[@]}"; do
    before="$(cat "$SRC/$f")"
    sed -i -E 's/(CMAKE_CXX_STANDARD[[:space:]]+)14\b/\117/' "$SRC/$f"
    [[ "$(cat "$SRC/$f")" != "$before" ]] || die "sed did not change $f"
    grep -qE 'CMAKE_CXX_STANDARD[[:space:]]+17' "$SRC/$f" || die "no CMAKE_CXX_STANDARD 17 in $f after sed"
    log "C++17: $f: $(grep -nE 'CMAKE_CXX_STANDARD[[:space:]]+17' "$SRC/$f" | tr '\n' ' ')"
done
if (cd "$SRC" && grep -rnE 'CMAKE_CXX_STANDARD[[:space:]]+14' --include=CMakeLists.txt --include='*.cmake' . \
        | grep -v '^\./third_party/'); then
    die "CMAKE_CXX_STANDARD 14 still present (see above)"
fi

# --- HOROVOD_GLOO_IFACE for process sets -----------------------------------------
# GlooContext::InitializeForProcessSet() (run by hvd.init() for the global process
# set too) builds its gloo device from its own, never-set gloo_iface_, so it
# ignores HOROVOD_GLOO_IFACE and falls back to resolving gethostname(). Where the
# hostname resolves to 127.0.0.1 (containers, network namespaces) peers are then
# told to connect to their own loopback and hvd.init() dies with
# "connect [127.0.0.1]:NNNN: Connection refused". Copy the global context's iface.
GLOO_CTX="$SRC/horovod/common/gloo/gloo_context.cc"
sed -i '/^void GlooContext::InitializeForProcessSet/,/^}/ s/^\([[:space:]]*\)device_attr\.iface = gloo_iface_;/\1gloo_iface_ = global_context.gloo_iface_;\n\1device_attr.iface = gloo_iface_;/' "$GLOO_CTX"
[[ "$(grep -c 'gloo_iface_ = global_context.gloo_iface_;' "$GLOO_CTX")" -eq 1 ]] \
    || die "patching InitializeForProcessSet in $GLOO_CTX failed; sdist changed?"
log "patched $(grep -n 'gloo_iface_ = global_context.gloo_iface_;' "$GLOO_CTX" | cut -d: -f1 | sed 's|^|horovod/common/gloo/gloo_context.cc:|'): process sets honour HOROVOD_GLOO_IFACE"

# --- build + install -----------------------------------------------------------
# setup.py passes '-j8' to make unless MAKEFLAGS is set; CMAKE_BUILD_PARALLEL_LEVEL
# makes 'cmake --build' pass -jN to make or ninja.
log "building Horovod ${HVD_VERSION} (this takes several minutes)"
start=$SECONDS
(
    cd "$WORKDIR"
    export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
           HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
           MAKEFLAGS="-j${JOBS}" CMAKE_BUILD_PARALLEL_LEVEL="${JOBS}"
    pip_install -v --no-build-isolation --no-deps --no-cache-dir "$SRC"
)
log "build + install took $((SECONDS - start)) s"

# Runtime deps (installed above already; this makes pip verify them, torch pinned).
pip_install cloudpickle psutil pyyaml packaging 'cffi>=1.4.0'

TORCH_AFTER="$(cd / && "$PY" -c 'import torch; print(torch.__version__)')"
[[ "$TORCH_AFTER" == "$TORCH_VERSION" ]] \
    || die "torch changed from ${TORCH_VERSION} to ${TORCH_AFTER}"
log "torch still ${TORCH_AFTER}"

# --- 3. check ------------------------------------------------------------------
(cd / && "$PY" -c "$CHECK_PY") || die "installed Horovod fails the import check"

SCRIPTS_DIR="$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')"
HOROVODRUN="$SCRIPTS_DIR/horovodrun"
[[ -x "$HOROVODRUN" ]] || HOROVODRUN="$(command -v horovodrun)" || die "horovodrun not found"
command -v pyenv >/dev/null 2>&1 && pyenv rehash >/dev/null 2>&1 || true

CHECK_OUT="$(cd / && "$HOROVODRUN" --check-build 2>&1)" || { printf '%s\n' "$CHECK_OUT"; die "horovodrun --check-build failed"; }
printf '%s\n' "$CHECK_OUT"
grep -qE '^[[:space:]]*\[X\] PyTorch[[:space:]]*$' <<<"$CHECK_OUT" || die "PyTorch not available in Horovod build"
[[ "$(grep -cE '^[[:space:]]*\[X\] Gloo[[:space:]]*$' <<<"$CHECK_OUT")" -eq 2 ]] \
    || die "Gloo controller/tensor operations not available in Horovod build"
log "Horovod ${HVD_VERSION} installed with PyTorch and Gloo ($HOROVODRUN)"
