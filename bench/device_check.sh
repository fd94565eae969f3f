#!/usr/bin/env bash
# The checks that need a GPU, in under 8 minutes on one GPU machine, in the order of issues 24 and 40
# (what most likely finds a defect first, so a cut-short run still says the most):
#   0. prebuild: the native kernel built (or loaded from its cache) before anything is timed, with
#      its seconds, the torch/CUDA versions, and which kernel kernel="auto" picks on this torch,
#   1. python -m bench.device_checks (python -m bench.device_checks --list says what each asserts):
#      races (in-place gradient changes queued behind a GPU sleep, step() without a sync, A -> B
#      -> A; also with a copy stream slowed by GPU sleeps and with the CPU kernels slowed by a
#      competing load), producer delays (GPU sleeps in backward pre-hooks: gradients final after
#      their hooks fired) against an independent reference (torch's AdamW on fp32 masters), torch's
#      and the native kernel, commits asserted, weights edited through .data followed (bf16/fp16,
#      overlap on and off), the gradient layouts (channels_last conv gradients, a .grad that a hook
#      set to a non-contiguous transposed view, accumulation of 3 backward passes under
#      opt.accumulating(); each bitwise overlap off AND the independent reference, bench/device_checks/_layouts.py),
#      host-device syncs counted in an overlapped backward and a clip,
#   2. FSDP2 with overlap and DDP with attach_ddp under NCCL (torchrun, 1 process); DDP with
#      gradient_as_bucket_view=True and DDP accumulating under no_sync(), each bitwise overlap off
#      AND the independent reference,
#   3. GradScaler fp16 with overflow steps, peak GPU memory of a 256M-element parameter's
#      backward + clip + step; then, in a step of its own, a ~1B bf16 model's backward and step
#      with and without overlap,
#   4. python -m bench.membus.bandwidth --device cuda (copy throughput each way and the step; 50M
#      parameters, fp32 and bf16, 2 thread counts),
#   5. the CUDA tests (-k cuda over tests/test_cuda_*.py and the files with a cuda marker or test;
#      -rs: a skipped native kernel shows),
#   6. the trainer on the GPU with the offloaded optimizer: --overlap-backward --clip-grad-norm 1.0,
#      and with --amp fp16 (125m GPT, 12 steps each).
# Steps 0-3's checks also run on the CPU in CI (--device cpu, tests/test_device_checks.py); there the
# producer check also runs the CUDA transport over a fake device that keeps a GPU's order
# (bench/device_checks/_fake_device.py), so a transport that drops the copy stream's wait on a gradient's ready
# event, or the weight copies' wait on the write event, fails in CI, before any GPU run.
# The time limits are estimates: the script has not yet run on a GPU. (The layouts took 10 s more for
# checks-races and 5 s for checks-dist, taken from train-overlap-clip, now its fp16 twin's 35 s for the
# same model and steps, and from pytest; the sum stays 460 s, 20 s left for the environment lines.) A step that runs past its
# limit gets SIGABRT (then SIGKILL 10 s later): with PYTHONFAULTHANDLER=1 every Python thread's stack
# goes to the log first, so a hang says where it hung; inside the checks, each check also dumps
# the stacks after --watchdog-s (bench/device_checks/_main.py) and a check that raises is reported and
# the next one runs.
# What it measured goes to bench/results/device/ (or $DEVICE_CHECK_OUT): the console log, pytest's
# report, the bandwidth .json/.md, the checks' JSON lines, the trainer summaries, and status.txt
# (each step's exit status).
#
#   bash bench/device_check.sh                  # PYTHON: .venv/bin/python if there, else python3; installs nothing
#   PYTHON=.venv/bin/python bash bench/device_check.sh
#   DEVICE_CHECK_PLAN=1 bash bench/device_check.sh   # print the steps and their limits, run nothing (any machine)
#
# Without a CUDA device (torch sees none; or PYTHON has no torch and the machine shows no NVIDIA
# device: no nvidia-smi, no /dev/nvidia0) it prints one line saying so and exits 0. Each step has its own timeout
# (their sum is under 8 minutes); the exit status is 1 if any step failed or timed out.
set -u
cd "$(dirname "$0")/.." || exit 2
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
OUT=${DEVICE_CHECK_OUT:-bench/results/device}
CPUS=$(nproc 2>/dev/null || echo 2)
HALF=$(( CPUS > 1 ? CPUS / 2 : 1 ))
# Test files with CUDA tests (test_cuda_*.py, a cuda marker, a test_cuda function); not all of tests/, whose client tests
# import packages the device machine may lack.
CUDA_TESTS=$( { ls tests/test_cuda_*.py; grep -lE "mark\.cuda|def test_cuda" tests/test_*.py; } | sort -u | tr '\n' ' ')
TRAIN="-m bench.train --device cuda --model-size 125m --batch-size 8 --seq-len 512 --steps 12 --optim-cpu-offload --log-level WARNING"

# name|timeout seconds|command (run with $PYTHON; word-split on purpose)
STEPS=(
  "prebuild|50|-m bench.device_checks --device cuda prebuild"
  "checks-races|85|-m bench.device_checks --device cuda races producer commits data_edits layouts syncs"
  "checks-dist|45|-m torch.distributed.run --nproc-per-node 1 -m bench.device_checks --device cuda dist"
  "checks-scale|30|-m bench.device_checks --device cuda scaler memory"
  "checks-timing|50|-m bench.device_checks --device cuda timing"
  "bandwidth|40|-m bench.membus.bandwidth --device cuda --dtypes fp32,bf16 --threads $HALF,$CPUS --chunks 4194304 --repeats 1 --name bandwidth-cuda --out-dir $OUT --log-level WARNING"
  "pytest|90|-m pytest -q -rs -p no:cacheprovider -k cuda $CUDA_TESTS --junitxml $OUT/pytest.xml"
  "train-overlap-clip|35|$TRAIN --overlap-backward --clip-grad-norm 1.0 --summary-json $OUT/train-overlap-clip.json"
  "train-overlap-clip-amp|35|$TRAIN --overlap-backward --clip-grad-norm 1.0 --amp fp16 --summary-json $OUT/train-overlap-clip-amp.json"
)

if [ -n "${DEVICE_CHECK_PLAN:-}" ]; then
  for s in "${STEPS[@]}"; do
    IFS='|' read -r name limit cmd <<<"$s"
    echo "$name|$limit|$PYTHON $cmd"
  done
  exit 0
fi

# A machine that shows no NVIDIA device has nothing to check, whatever PYTHON is.
no_gpu_here() { ! command -v nvidia-smi >/dev/null 2>&1 && [ ! -e /dev/nvidia0 ]; }
if ! command -v "$PYTHON" >/dev/null 2>&1; then
  if no_gpu_here; then
    echo "device_check: no CUDA device (no nvidia-smi, no /dev/nvidia0; PYTHON=$PYTHON is not here either): nothing to check, skipped"
    exit 0
  fi
  echo "device_check: PYTHON=$PYTHON is not an executable here; set PYTHON to a python with torch" >&2
  exit 2
fi
# One interpreter start (importing torch takes seconds): 0 a CUDA device, 4 none, else no torch.
"$PYTHON" -c "import sys
try:
    import torch
except Exception:
    sys.exit(3)
sys.exit(0 if torch.cuda.is_available() else 4)" >/dev/null 2>&1
probe=$?
if [ "$probe" -eq 4 ]; then
  echo "device_check: no CUDA device (torch.cuda.is_available() is False for $PYTHON): nothing to check, skipped"
  exit 0
elif [ "$probe" -ne 0 ] && no_gpu_here; then
  echo "device_check: no CUDA device (no nvidia-smi, no /dev/nvidia0; $PYTHON cannot import torch): nothing to check, skipped"
  exit 0
elif [ "$probe" -ne 0 ]; then
  echo "device_check: $PYTHON cannot import torch (status $probe); set PYTHON to a python with torch (nothing is installed)" >&2
  exit 2
fi

mkdir -p "$OUT" || exit 2
LOG="$OUT/device_check.log"
: >"$LOG"
: >"$OUT/status.txt"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONFAULTHANDLER=1  # SIGABRT from timeout below: every thread's stack, then the exit
{
  echo "== environment ($(date -u +%FT%TZ))"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || true
  "$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
  echo "cpus $CPUS; git $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
} 2>&1 | tee -a "$LOG"

failed=0
for s in "${STEPS[@]}"; do
  IFS='|' read -r name limit cmd <<<"$s"
  echo "== $name (timeout ${limit}s): $PYTHON $cmd" | tee -a "$LOG"
  start=$(date +%s)
  # timeout sends its signal to its child, then to its whole process group: a Python child would
  # get SIGABRT twice, and the second, once faulthandler has put the default action back to
  # write its dump, kills it mid-dump ("Fatal Python error: " and nothing after, seen once in a
  # test). The child is a shell that catches the first (its trap resets to the default in
  # Python, which then gets one, from the group signal, as does every torchrun worker).
  # shellcheck disable=SC2086,SC2016
  timeout -s ABRT -k 10 "$limit" bash -c 'trap : ABRT; "$@"' step "$PYTHON" $cmd 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  echo "$name rc=$rc seconds=$(( $(date +%s) - start ))" | tee -a "$LOG" >>"$OUT/status.txt"
  [ "$rc" -eq 0 ] || failed=1
done
echo "== done: $(tr '\n' ' ' <"$OUT/status.txt")" | tee -a "$LOG"
exit "$failed"
