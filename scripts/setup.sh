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

# From Debian's packages: Fashion-MNIST (the embedded default and the real-data tests) and Chromium with its
# driver (the browser test of the demo page). Skipped when present, when not root, or with MOH_DIT_SKIP_APT.
wanted=()
[ -e /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] || wanted+=(dataset-fashion-mnist)
command -v chromium >/dev/null || wanted+=(chromium)
command -v chromedriver >/dev/null || wanted+=(chromium-driver)
if [ ${#wanted[@]} -gt 0 ] && [ -z "${MOH_DIT_SKIP_APT:-}" ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${wanted[@]}" >/dev/null) \
        || echo "note: could not install ${wanted[*]} (Fashion-MNIST: set data.path; Chromium: the browser test is skipped)"
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
