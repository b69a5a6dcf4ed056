#!/usr/bin/env bash
# The prepared check for a lent GPU machine, in ONE call of at most 9 minutes (the parts' time
# limits add up to 540 s; a lent machine runs one command for at most 10 minutes). Its parts,
# the headline first, each under its own limit (killed with its children when it runs over):
#   1. peers_8192: fnt sft against a bare PyTorch loop and TRL's SFTTrainer at the Qwen3-0.6B
#      shape, seq_len 8192, the same rows (scripts/bench_peers.py: s/step, tokens/s, MFU, peak
#      memory, what fnt's defaults chose for attention and compile, fnt/TRL and fnt/bare),
#   2. peers_2048: the same at seq_len 2048,
#   3. loss: model.loss_kernel on the LM head alone at Qwen3's vocabulary, 8192 loss tokens:
#      eager and compiled chunks against a bare chunked cross entropy (scripts/bench_loss.py),
#   4. profile: a few fnt SFT steps at seq_len 8192 under torch.profiler (scripts/profile_step.py:
#      the top kernels by device time, the host syncs per step),
#   5. gpu_tests: the gpu-marked tests but vLLM's (varlen and flex attention: packed == alone,
#      flex's gradients; steps under sync-debug mode; compiled SFT and decoding against eager;
#      full offload on one CUDA rank; NUMA binding), each test's result and time in the log as
#      it ends (-v, --durations=0), so a part stopped at its limit still shows how far it got,
#   6. dpo: fnt dpo against TRL's DPOTrainer at the 0.6B shape, bf16 (scripts/bench_dpo.py),
#   7. rl: an RL step of the in-process engine at the 0.6B shape against a bare GRPO loop on the
#      same device (scripts/bench_rl.py --model).
# Usage, from the repository root on the GPU machine: bash scripts/gpu_check.sh [OUT_DIR]
# Every log and JSON line lands in OUT_DIR (default gpu-check/); the summary (each part's exit
# status and its last JSON line) is printed last; the exit status is non-zero if a part failed.
# The models (the 0.6B one is 2.4 GB), runs and the trace go to $FNT_GPU_WORK
# (/tmp/fnt-gpu-work), not OUT_DIR, which stays small; the sides' own logs are copied to OUT_DIR.
#
# The machine's image has torch and transformers but no registry: what fnt, the benchmarks and
# TRL need beyond the image is installed offline from .gpu-wheels/ (`make gpu-wheels` fills it
# here; carry it with the working tree) into /tmp/fnt-site ($FNT_GPU_SITE), and the checkout and
# that folder are the PYTHONPATH (fnt is not installed). $PYTHON picks the interpreter (python3).
#
# FNT_GPU_CHECK_TINY=1 is the dry run for a machine without a GPU: the benchmarks at their --tiny
# (CPU-sized) settings, and the gpu-marked tests only collected, to catch shell, path and import
# errors before the GPU machine's one try.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu-check}
PY=${PYTHON:-python3}
SITE=${FNT_GPU_SITE:-/tmp/fnt-site}
WORK=${FNT_GPU_WORK:-/tmp/fnt-gpu-work}
TINY=${FNT_GPU_CHECK_TINY:-0}
mkdir -p "$OUT" "$WORK"

if [ -d .gpu-wheels ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" .gpu-wheels/*.whl \
    2>&1 | tee "$OUT/install.log"
fi
export PYTHONPATH=$PWD:$SITE PYTHONUNBUFFERED=1
# The wheels' commands (ninja, which builds the native AdamW) land in $SITE/bin.
export PATH=$SITE/bin:$PATH
# No registry or hub is reachable there: nothing may wait on one.
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 WANDB_MODE=disabled
"$PY" - <<'EOF' 2>&1 | tee "$OUT/env.log"
import importlib, shutil, sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name() if torch.cuda.is_available() else "")
print("ninja", shutil.which("ninja"), "c++", shutil.which("c++"))  # the native AdamW's build
for name in ("transformers", "trl", "datasets", "accelerate", "peft", "dataclasses_json", "fnt"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"), module.__file__)
    except Exception as e:
        print(name, "NOT IMPORTABLE:", repr(e))
EOF

PARTS=()
declare -A RC
# run_part NAME SECONDS COMMAND...: the command under `timeout -s KILL SECONDS` (the whole
# process group: a benchmark's subprocesses too), its output in OUT/NAME.log.
run_part() {
  local name=$1 seconds=$2
  shift 2
  echo "== $name (at most $seconds s): $*"
  timeout -s KILL "$seconds" "$@" 2>&1 | tee "$OUT/$name.log"
  RC[$name]=${PIPESTATUS[0]}
  PARTS+=("$name")
}

if [ "$TINY" = 1 ]; then
  SHAPE=tiny
  PEERS_8192=(--tiny --steps 3)
  PEERS_2048=(--tiny --steps 3 --seq-len 128)
  PROFILE=(--tiny)
  LOSS=(--tiny --seq-lens 512 --reps 2)
  TESTS=(--collect-only)
  DPO=(--steps 3 --warmup 1 --pairs 64)
  RL=(--steps 2 --warmup 1)
else
  SHAPE=0.6b
  PEERS_8192=(--seq-len 8192 --steps 8 --side-timeout 90)
  PEERS_2048=(--seq-len 2048 --steps 8 --side-timeout 60)
  PROFILE=(--seq-len 8192 --warmup 3 --steps 3)
  LOSS=(--seq-lens 8192 --reps 10)
  TESTS=()
  DPO=(--shape 0.6b --steps 8 --warmup 3)
  RL=(--steps 4 --warmup 1)
fi
MODEL=$WORK/peers/qwen3-$SHAPE  # written by the first part, read by the others

run_part peers_8192 150 "$PY" scripts/bench_peers.py "${PEERS_8192[@]}" --work "$WORK/peers"
run_part peers_2048 100 "$PY" scripts/bench_peers.py "${PEERS_2048[@]}" --work "$WORK/peers"
run_part loss 40 "$PY" scripts/bench_loss.py --kernels "${LOSS[@]}"
[ -f "$MODEL/config.json" ] && PROFILE+=(--model "$MODEL")
run_part profile 50 "$PY" scripts/profile_step.py "${PROFILE[@]}" --work "$WORK/profile"
run_part gpu_tests 100 "$PY" -m pytest -v -m "gpu and not vllm" -p no:cacheprovider --durations=0 ${TESTS[@]+"${TESTS[@]}"} tests
if [ "$TINY" != 1 ] && [ -f "$MODEL/config.json" ]; then
  DPO+=(--model "$MODEL")
  RL+=(--model "$MODEL")
fi
run_part dpo 50 "$PY" scripts/bench_dpo.py "${DPO[@]}" --work "$WORK/dpo"
run_part rl 50 "$PY" scripts/bench_rl.py "${RL[@]}" --work "$WORK/rl"

for log in "$WORK"/peers/seq*/*.log; do  # each side's own output (fnt sft, TRL, bare)
  [ -f "$log" ] && cp "$log" "$OUT/peers-$(basename "$(dirname "$log")")-$(basename "$log")"
done

echo "== summary (OUT=$OUT, WORK=$WORK)"
failed=0
for name in "${PARTS[@]}"; do
  rc=${RC[$name]}
  [ "$rc" = 0 ] || failed=1
  if [ "$name" = gpu_tests ]; then
    last=$(grep -E "passed|failed|error|collected|no tests ran" "$OUT/$name.log" | tail -n 1)
  else
    last=$(grep "^{" "$OUT/$name.log" | tail -n 1)
  fi
  echo "$name rc=$rc ${last:-(no result line)}"
done
exit $failed
