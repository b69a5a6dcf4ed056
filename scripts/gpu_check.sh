#!/usr/bin/env bash
# The prepared check for a lent GPU machine, in two calls of at most 9 minutes each (a lent
# machine runs one command for at most 10 minutes): `main` (the default) runs parts 1-4,
# `vllm` runs part 5:
#   1. the gpu-marked tests (varlen attention: packed == alone; model.compile: eager vs compiled
#      SFT losses and decoding tokens; without vLLM),
#   2. the memory benchmark up to seq_len 8192 (scripts/bench_memory.py),
#   3. a throughput run at a real shape (scripts/bench_throughput.py: Qwen3-0.6B-shaped random
#      weights, bf16 compute, seq_len 8192, a varlen kernel if flash-attn is installed),
#   4. eager vs model.compile at the ~50M Qwen3 shape and at the real shape, seq_len 2048
#      (scripts/bench_throughput.py --compile: step times, compile seconds, break-even steps),
#      and the demo's RL step eager vs compiled (scripts/bench_rl.py --compile),
#   5. where vllm is importable: the vLLM engine on the GPU: the gpu-marked vLLM tests (RL with
#      the policy sent over NCCL) and scripts/bench_rl.py --engine vllm (the reverse-text task:
#      seconds per step and generation tokens/s against the in-process engine).
# Usage, from the repository root on the GPU machine: bash scripts/gpu_check.sh [OUT_DIR] [main|vllm]
# Each part has its own time limit, so one that hangs cannot eat the others' time; every log and
# the JSON lines land in OUT_DIR (default gpu-check/), and the summary is printed last.
# The machine's image provides torch and transformers; fnt's other pure-Python dependencies are
# installed from wheels in .gpu-wheels/ when that folder exists (prepare it here with
# `pip download dataclasses-json -d .gpu-wheels`), since the machine cannot reach a registry.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu-check}
PART=${2:-main}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1

if [ -d .gpu-wheels ]; then
  "$PY" -m pip install -q --no-index --find-links .gpu-wheels dataclasses-json
fi
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" \
  | tee "$OUT/env.log"

if [ "$PART" = main ]; then
  timeout 150 "$PY" -m pytest -q -m "gpu and not vllm" -p no:cacheprovider tests 2>&1 \
    | tee "$OUT/gpu_tests.log"
  tests_rc=${PIPESTATUS[0]}
  timeout 75 "$PY" scripts/bench_memory.py --seq-lens 1024,2048,4096,8192 --skip-ranks \
    --work "$OUT/models" 2>&1 | tee "$OUT/bench_memory.log"
  memory_rc=${PIPESTATUS[0]}
  timeout 75 "$PY" scripts/bench_throughput.py --seq-len 8192 --steps 6 --work "$OUT/throughput" \
    2>&1 | tee "$OUT/bench_throughput.log"
  throughput_rc=${PIPESTATUS[0]}
  timeout 60 "$PY" scripts/bench_throughput.py --medium --compile --steps 8 \
    --work "$OUT/compile_medium" 2>&1 | tee "$OUT/bench_compile_medium.log"
  compile_rc=${PIPESTATUS[0]}
  timeout 105 "$PY" scripts/bench_throughput.py --compile --seq-len 2048 --steps 8 \
    --work "$OUT/compile" 2>&1 | tee "$OUT/bench_compile.log"
  compile_rc=$compile_rc${PIPESTATUS[0]}
  timeout 60 "$PY" scripts/bench_rl.py --compile --steps 4 --work "$OUT/compile_rl" 2>&1 \
    | tee "$OUT/bench_compile_rl.log"
  compile_rc=$compile_rc${PIPESTATUS[0]}
  echo "gpu tests rc=$tests_rc, memory benchmark rc=$memory_rc, throughput rc=$throughput_rc," \
    "compile (medium, 0.6b, rl) rc=$compile_rc"
  for log in bench_memory bench_throughput bench_compile_medium bench_compile bench_compile_rl; do
    tail -n 1 "$OUT/$log.log"
  done
  [ "$tests_rc$memory_rc$throughput_rc$compile_rc" = "000000" ]
elif [ "$PART" = vllm ]; then
  if "$PY" -c "import vllm" 2>/dev/null; then
    export FNT_VLLM=${FNT_VLLM:-$(command -v vllm)}
    timeout 180 "$PY" -m pytest -q -m "gpu and vllm" -p no:cacheprovider tests 2>&1 \
      | tee "$OUT/vllm_tests.log"
    vllm_tests_rc=${PIPESTATUS[0]}
    timeout 180 "$PY" scripts/bench_rl.py --engine vllm --steps 6 --work "$OUT/bench_rl" 2>&1 \
      | tee "$OUT/bench_rl_vllm.log"
    vllm_rc=$vllm_tests_rc${PIPESTATUS[0]}
    tail -n 1 "$OUT/bench_rl_vllm.log"
  else
    echo "vllm is not importable here: the vLLM parts did not run" | tee "$OUT/vllm_tests.log"
    vllm_rc=missing
  fi
  echo "vllm (tests, benchmark) rc=$vllm_rc"
  [ "$vllm_rc" = "00" ]
else
  echo "gpu_check.sh: the part is main or vllm, not '$PART'" >&2
  exit 2
fi
