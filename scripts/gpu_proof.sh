#!/usr/bin/env bash
# The GPU proof in one command, for a lent GPU machine without network (Python 3.12, torch 2.11 + CUDA, accelerate,
# numpy, pillow, safetensors; not diffusers or torch-fidelity, which travel as wheels: scripts/gpu_wheels.sh):
#
#   bash scripts/gpu_proof.sh OUT            # install the carried wheels into a temporary target, run the CUDA-marked
#                                            # tests and a short selection of the suite, then benchmarks/gpu_proof.py
#   bash scripts/gpu_proof.sh --dry-run OUT  # every step at toy size on this machine (CPU), in well under 2 minutes
#
# With the device tool: run(command="bash scripts/gpu_proof.sh benchmarks/results/gpu", carry=["gpu_wheels"]).
# OUT gets gpu_proof_<device>.{json,md} and steps.log (each step's seconds). Wheels: $MOH_DIT_WHEELS (gpu_wheels/).
set -euo pipefail
cd "$(dirname "$0")/.."
dry_run=0
out=""
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry_run=1 ;;
    -h|--help) sed -n 2,11p "$0"; exit 0 ;;
    -*) echo "error: unknown option $arg (--dry-run, or a folder)" >&2; exit 2 ;;
    *) out=$arg ;;
  esac
done
[ -n "$out" ] || { echo "error: give the folder the results go to: bash scripts/gpu_proof.sh [--dry-run] OUT" >&2; exit 2; }
mkdir -p "$out"
python=${PYTHON:-}
if [ -z "$python" ]; then
  if [ "$dry_run" = 1 ] && [ -x .venv/bin/python ]; then python=.venv/bin/python; else python=python3; fi
fi
wheels=${MOH_DIT_WHEELS:-gpu_wheels}
log="$out/steps.log"
: > "$log"
step() {  # step NAME COMMAND...: run it, time it, log it; a failing step stops the proof with its name
  local name=$1; shift
  local start=$SECONDS
  echo "== $name" | tee -a "$log"
  if "$@"; then
    echo "   $name: $((SECONDS - start)) s" | tee -a "$log"
  else
    local rc=$?
    echo "   $name: FAILED (exit $rc) after $((SECONDS - start)) s" | tee -a "$log"
    exit "$rc"
  fi
}

site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
install() {
  if compgen -G "$wheels/*.whl" > /dev/null; then
    "$python" -m pip install --quiet --no-index --no-deps --target "$site" "$wheels"/*.whl
  elif [ "$dry_run" = 1 ]; then
    echo "   no $wheels/: skipped (the dry run uses this environment's packages)"
  else
    echo "error: no wheels in $wheels/: run scripts/gpu_wheels.sh where PyPI is reachable, and carry the folder" >&2
    return 1
  fi
}
step "install the carried wheels" install
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
step "versions" "$python" -c "import torch, diffusers, moh_dit; print('torch', torch.__version__, '| cuda', torch.cuda.is_available(), '| diffusers', diffusers.__version__, '| moh-dit', moh_dit.__version__)"

tests() {  # every CUDA-marked test, then a short selection of the suite (on the dry run: the CUDA tests, which skip)
  local pytest=("$python" -m pytest -q -p no:cacheprovider -o addopts="")
  if [ "$dry_run" = 1 ]; then "${pytest[@]}" -m cuda tests/test_cuda.py; return; fi
  "${pytest[@]}" -m cuda tests && "${pytest[@]}" tests/model/test_execution.py tests/model/test_attention.py
}
step "CUDA-marked tests and a short selection of the suite" tests
step "measurements" "$python" benchmarks/gpu_proof.py --out "$out" $([ "$dry_run" = 1 ] && echo --dry-run)
echo "done: $out" | tee -a "$log"
