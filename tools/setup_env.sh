#!/usr/bin/env bash
# Make .venv/ with everything the course needs. Safe to re-run: it does nothing when
# .venv is already up to date with requirements.txt and pyproject.toml.
#
# torch is chosen before anything else can pull it in:
#   - a Python that already has a CUDA-enabled torch keeps it (the venv sees its packages);
#   - otherwise torch==$NANOSERVE_TORCH_VERSION is installed, from $NANOSERVE_TORCH_INDEX when set
#     (e.g. PyTorch's CPU wheel index on a laptop, so pip does not fetch a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
VENV=.venv
STAMP="$VENV/.nanoserve-installed"
TORCH_VERSION="${NANOSERVE_TORCH_VERSION:-2.13.0}"

if [[ -f "$STAMP" && "$STAMP" -nt requirements.txt && "$STAMP" -nt requirements-clients.txt && "$STAMP" -nt pyproject.toml ]]; then
  exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
  if "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "setup: keeping the CUDA torch of $PYTHON (venv with --system-site-packages)"
    "$PYTHON" -m venv --system-site-packages "$VENV"
  else
    "$PYTHON" -m venv "$VENV"
  fi
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)

if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "setup: installing torch==$TORCH_VERSION"
  if [[ -n "${NANOSERVE_TORCH_INDEX:-}" ]]; then
    "${PIP[@]}" install "torch==$TORCH_VERSION" --index-url "$NANOSERVE_TORCH_INDEX"
  else
    "${PIP[@]}" install "torch==$TORCH_VERSION"
  fi
fi

# The rest goes through uv when it installs (it unpacks and byte-compiles in parallel: about a third of
# pip's time on 2 cores); pip does it where uv cannot be had or cannot reach an index. The torch just chosen
# is held by a constraint: the clients' dependencies would otherwise replace it with a newer (CUDA) build.
echo "setup: installing requirements.txt and requirements-clients.txt"
HOLD="$VENV/.torch-constraint.txt"
"$VENV/bin/python" -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > "$HOLD"
REQS=(-r requirements.txt -r requirements-clients.txt -c "$HOLD")
UV=("$VENV/bin/python" -m uv pip install -q --python "$VENV/bin/python" --compile-bytecode)
if "${PIP[@]}" install uv 2>/dev/null && "${UV[@]}" "${REQS[@]}" -e .; then
  :
else
  echo "setup: uv unavailable, installing with pip"
  "${PIP[@]}" install "${REQS[@]}"
  "${PIP[@]}" install --no-deps -e .
fi
"$VENV/bin/python" -c "import torch, nanoserve; print('setup: torch', torch.__version__, '| cuda', torch.cuda.is_available())"
touch "$STAMP"
