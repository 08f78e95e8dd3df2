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
# Not huggingface-hub: the image's 1.x satisfies diffusers (>=1.32), and the image's transformers refuses 2.x (diffusers
# imports transformers when it is installed, so a carried 2.x broke every diffusers import there, 2026-12-04).
packages=(
  "diffusers==$(version diffusers)" "torch-fidelity==$(version torch-fidelity)" "regex" "importlib_metadata" "zipp"
  "lazy-importer" "requests" "urllib3" "idna" "certifi" "charset-normalizer" "tqdm" "pyyaml" "filelock" "fsspec"
  "typing-extensions" "hf-xet" "pytest" "iniconfig" "pluggy" "pygments" "packaging"
)
"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --dest "$out" "${packages[@]}"
du -sh "$out"
ls "$out"
# what the carried wheels need (Python 3.12 on Linux) and do not carry: the image must hold each of these
"$python" - "$out" <<'PY'
import re, sys, zipfile
from pathlib import Path
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux", "platform_system": "Linux",
       "platform_machine": "x86_64", "os_name": "posix", "implementation_name": "cpython", "extra": ""}
carried, needs = set(), set()
for wheel in Path(sys.argv[1]).glob("*.whl"):
    with zipfile.ZipFile(wheel) as z:
        text = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    carried.add(canonicalize_name(re.search(r"^Name: (.+)$", text, re.M).group(1)))
    for line in text.splitlines():
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1])
            if req.marker is None or req.marker.evaluate(env):
                needs.add(f"{canonicalize_name(req.name)}{req.specifier}")
left = sorted(n for n in needs if re.match(r"[a-z0-9-]+", n).group(0) not in carried)
print("the image must provide:", ", ".join(left) or "nothing")
PY
