#!/usr/bin/env bash
# The wheels the GPU proof carries to a machine without network (scripts/gpu_proof.sh installs them): what moh-dit
# needs beyond that image's Python 3.12, torch 2.11, accelerate, numpy, pillow and safetensors. Pure-Python wheels and
# CPython 3.12 manylinux builds, no dependencies resolved against this machine; run where PyPI is reachable:
#
#   bash scripts/gpu_wheels.sh            # -> gpu_wheels/ (git ignores it; the device tool's carry takes it)
#
# torchvision and scipy (torch-fidelity's) stay behind: the proof measures training and sampling, not FID.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu_wheels}
python=${PYTHON:-.venv/bin/python}
mkdir -p "$out"
version() { "$python" -c "import importlib.metadata as m; print(m.version('$1'))"; }
packages=(
  "diffusers==$(version diffusers)" "torch-fidelity==$(version torch-fidelity)" "regex" "importlib_metadata" "zipp"
  "requests" "urllib3" "idna" "certifi" "charset-normalizer" "tqdm" "pyyaml" "huggingface-hub==$(version huggingface-hub)"
  "filelock" "fsspec" "typing-extensions" "hf-xet" "pytest" "iniconfig" "pluggy" "pygments" "packaging"
)
"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --dest "$out" "${packages[@]}"
du -sh "$out"
ls "$out"
