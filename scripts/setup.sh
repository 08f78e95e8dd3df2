#!/usr/bin/env bash
# Create .venv and install moh-dit with its test and plot extras.
#
# On CPU machines (and CI) the torch/torchvision pair in constraints/cpu.txt is used: it is known to work
# with torch-fidelity (which imports torchvision). GPU users who want their own torch build run
#   MOH_DIT_CONSTRAINTS=none bash scripts/setup.sh
# after installing torch/torchvision into .venv, or simply `pip install -e ".[dev]"` in their environment.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
CONSTRAINTS=${MOH_DIT_CONSTRAINTS:-constraints/cpu.txt}

if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
args=(-e ".[dev,plot]")
if [ "$CONSTRAINTS" != "none" ]; then
    args=(-c "$CONSTRAINTS" "${args[@]}")
fi
# (the filter only hides pip's noise about this machine's local package index; pip's status is kept)
.venv/bin/python -m pip install --quiet --disable-pip-version-check "${args[@]}" \
    2> >(grep -v "is ignored: it is neither" >&2)

# Fashion-MNIST for the embedded default and the real-data tests: Debian ships the IDX files.
if [ ! -e /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] && [ -z "${MOH_DIT_SKIP_APT:-}" ] \
        && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist >/dev/null) \
        || echo "note: could not install dataset-fashion-mnist; set data.path to a folder with the IDX files"
fi
.venv/bin/python - <<'PY'
import torch, torchvision, torch_fidelity, diffusers, accelerate
# torch-fidelity imports torchvision, whose compiled ops must match torch (a mismatch fails here, not in a test)
boxes = torch.tensor([[0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 1.0]])
assert torchvision.ops.nms(boxes, torch.tensor([0.9, 0.8]), 0.5).tolist() == [0], "torchvision's ops are broken"
print(f"moh-dit environment ready: torch {torch.__version__}, torchvision {torchvision.__version__}, "
      f"diffusers {diffusers.__version__}, accelerate {accelerate.__version__}, "
      f"torch-fidelity {torch_fidelity.__version__}, cuda={torch.cuda.is_available()}")
PY
