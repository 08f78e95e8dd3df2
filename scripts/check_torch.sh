#!/usr/bin/env bash
# Run the package's import and its model and trainer tests under another torch, on CPU, in a venv of its own:
#
#   bash scripts/check_torch.sh 2.11.0 0.26.0       # torch and the torchvision of the same release -> /tmp/torch-2.11.0
#
# Not part of CI: PyPI's Linux torch brings ~3 GB of CUDA libraries (a CPU-only build is not in the registries this
# project reaches), so one check costs a few minutes and ~6 GB. Measured with 2.11.0 (the GPU image's) on 2026-11-28:
# 254 tests of tests/model and tests/training/test_trainer.py pass, and scripts/gpu_proof.sh --dry-run runs.
set -euo pipefail
cd "$(dirname "$0")/.."
torch_version=${1:?give the torch version, e.g. 2.11.0}
vision_version=${2:?give the torchvision version of the same release, e.g. 0.26.0}
venv=${VENV:-/tmp/torch-$torch_version}
python3 -m venv "$venv"
"$venv/bin/pip" install -q "torch==$torch_version" "torchvision==$vision_version"
"$venv/bin/pip" install -q -e ".[dev]" --constraint <(echo "torch==$torch_version"; echo "torchvision==$vision_version")
"$venv/bin/python" -c "import torch, moh_dit; print('torch', torch.__version__, '| moh-dit', moh_dit.__version__)"
OMP_NUM_THREADS=1 "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/model tests/training/test_trainer.py
