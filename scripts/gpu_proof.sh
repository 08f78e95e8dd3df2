#!/usr/bin/env bash
# The GPU proof in one command, for a lent GPU machine without network (Python 3.12, torch 2.11 + CUDA, accelerate,
# numpy, pillow, safetensors; not diffusers or torch-fidelity, which travel as wheels: scripts/gpu_wheels.sh):
#
#   bash scripts/gpu_proof.sh OUT            # install the carried wheels into a temporary target, run the CUDA-marked
#                                            # tests and a short selection of the suite, then benchmarks/gpu_proof.py
#   bash scripts/gpu_proof.sh --dry-run OUT  # every step at toy size on this machine (CPU), in well under 2 minutes
#   bash scripts/gpu_proof.sh --budget 330 OUT  # start no measurement after 330 s (a lent machine's time limit):
#                                            # the rest is recorded as skipped, the compilations first
#   bash scripts/gpu_proof.sh --sections training,compiled,profile,calibrate OUT
#                                            # these sections, in this order (default training,sampling,memory,
#                                            # compiled; profile and calibrate: benchmarks/gpu_diagnosis.py)
#
# With the device tool (15 minutes a session, the machine's start included):
#   run(command="bash scripts/gpu_proof.sh --budget 250 $OUT", carry=["gpu_wheels"])
# OUT gets gpu_proof_<device>.{json,md} (rewritten after each section), steps.log (each step's seconds) and tests.log.
# A failing test does not stop the measurements; the proof then exits non-zero. Wheels: $MOH_DIT_WHEELS (gpu_wheels/).
set -euo pipefail
cd "$(dirname "$0")/.."
dry_run=0
out=""
budget=()
sections=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry_run=1 ;;
    --budget)
      [[ "${2:-}" =~ ^[0-9]+$ ]] || { echo "error: --budget takes a whole number of seconds" >&2; exit 2; }
      budget=(--budget "$2"); shift ;;
    --sections)
      [[ "${2:-}" =~ ^[a-z,]+$ ]] || { echo "error: --sections takes a comma-separated list (see --help)" >&2; exit 2; }
      sections=(--sections "$2"); shift ;;
    -h|--help) sed -n '2,/^set /{/^#/p}' "$0"; exit 0 ;;  # the header, however long
    -*) echo "error: unknown option $1 (--dry-run, --budget SECONDS, --sections LIST, or a folder)" >&2; exit 2 ;;
    *) out=$1 ;;
  esac
  shift
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
failed=""
step() {  # step [--go-on] NAME COMMAND...: run it, time it, log it; a failing step stops the proof with its name,
  local go_on=0  # unless --go-on (the tests: the measurements still run, and the proof exits non-zero at the end)
  if [ "$1" = --go-on ]; then go_on=1; shift; fi
  local name=$1; shift
  local start=$SECONDS
  echo "== $name" | tee -a "$log"
  if "$@"; then
    echo "   $name: $((SECONDS - start)) s" | tee -a "$log"
  else
    local rc=$?
    echo "   $name: FAILED (exit $rc) after $((SECONDS - start)) s" | tee -a "$log"
    [ "$go_on" = 1 ] || exit "$rc"
    failed="$failed $name;"
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
  local pytest=("$python" -m pytest -q -p no:cacheprovider -o addopts="" -rfEs)
  if [ "$dry_run" = 1 ]; then "${pytest[@]}" -m cuda tests/test_cuda.py 2>&1 | tee "$out/tests.log"; return; fi
  { "${pytest[@]}" -m cuda tests && "${pytest[@]}" tests/model/test_execution.py tests/model/test_attention.py; } 2>&1 |
    tee "$out/tests.log"
}
step --go-on "CUDA-marked tests and a short selection of the suite" tests
dry=()
[ "$dry_run" = 1 ] && dry=(--dry-run)
step "measurements" "$python" benchmarks/gpu_proof.py --out "$out" "${dry[@]}" "${budget[@]}" "${sections[@]}"
if [ -n "$failed" ]; then
  echo "done with failures:$failed see $out/tests.log" | tee -a "$log"
  exit 1
fi
echo "done: $out" | tee -a "$log"
