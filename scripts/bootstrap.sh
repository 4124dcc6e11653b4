#!/usr/bin/env bash
# Create the project's virtual environment and install cadlib with its notebook and dev extras.
# Called by `make`; safe to rerun. On a machine whose python already has torch (a GPU node), the
# venv sees the system site-packages so that node's own torch build is used. Elsewhere a CPU build
# of torch is installed first (TORCH_SPEC, default torch==2.13.0), so pip never resolves the bare
# `torch` requirement to a multi-GB CUDA build. Extra pip arguments for that step: TORCH_PIP_ARGS.
set -euo pipefail
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}

if [ ! -x "$VENV/bin/python" ]; then
  if "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    echo "[bootstrap] $PYTHON already has torch: creating $VENV with system site-packages"
    "$PYTHON" -m venv --system-site-packages "$VENV"
  else
    echo "[bootstrap] creating $VENV"
    "$PYTHON" -m venv "$VENV"
  fi
fi
PY="$VENV/bin/python"
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "[bootstrap] installing $TORCH_SPEC"
  # shellcheck disable=SC2086
  "$PY" -m pip install -q --disable-pip-version-check "$TORCH_SPEC" ${TORCH_PIP_ARGS:-}
fi
echo "[bootstrap] installing cadlib[notebooks,dev]"
"$PY" -m pip install -q --disable-pip-version-check -e ".[notebooks,dev]" 2>&1 \
  | grep -v "is ignored: it is neither a file nor a directory" || true
"$PY" -c "import cadlib, torch, papermill, nbval, plotly; print('[bootstrap] ok: torch', torch.__version__)"
