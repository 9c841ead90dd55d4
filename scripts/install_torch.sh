#!/bin/sh
# Install PyTorch into the given interpreter's environment without ever pulling a CUDA build onto
# a machine that has no CUDA: an already importable torch is left alone; otherwise the pinned
# version is installed (on the project's CPU machines pip resolves it to the local CPU wheel).
# Set TORCH_INDEX_URL to force a specific wheel index (e.g. a CPU-only index elsewhere).
set -eu
PY="$1"
VERSION="${TORCH_VERSION:-2.13.0}"
if "$PY" -c "import torch" 2>/dev/null; then
    echo "torch $("$PY" -c 'import torch; print(torch.__version__)') already installed; leaving it"
    exit 0
fi
if [ -n "${TORCH_INDEX_URL:-}" ]; then
    exec "$PY" -m pip install --quiet --disable-pip-version-check "torch==$VERSION" --index-url "$TORCH_INDEX_URL"
fi
if command -v nvidia-smi >/dev/null 2>&1; then
    exec "$PY" -m pip install --quiet --disable-pip-version-check "torch==$VERSION"
fi
# No CUDA here: take a locally available wheel of the pinned version first (the project's CPU
# machines carry the CPU build on disk), then let pip add torch's ordinary dependencies.
if "$PY" -m pip install --quiet --disable-pip-version-check --no-index --no-deps "torch==$VERSION" 2>/dev/null; then
    exec "$PY" -m pip install --quiet --disable-pip-version-check "torch==$VERSION"
fi
echo "warning: no local torch==$VERSION wheel; installing from the default index. To avoid a" >&2
echo "CUDA build on a CPU-only machine, set TORCH_INDEX_URL to a CPU wheel index." >&2
exec "$PY" -m pip install --quiet --disable-pip-version-check "torch==$VERSION"
