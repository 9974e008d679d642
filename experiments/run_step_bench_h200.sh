#!/usr/bin/env bash
# Everything issue 5's performance core measures, in one device call (built here, carried): the GPU-vs-CPU
# parity check, `specula bench step` on the three random-weight shapes, and the HF peer baseline on
# llama3.2-1b. Writes log.txt and results.tar.gz (refreshed after every part, so a cut-off call keeps what
# it measured) into $OUT.
# Usage on the device: SPECULA_GIT_REVISION=<rev> bash experiments/run_step_bench_h200.sh [parts]
#   parts: any of l1,check,hf,qwen,l8 (default: all, in that order: the must-show shape first)
set -uo pipefail
out=/tmp/specula_results
mkdir -p "$out"
parts=${1:-l1,check,hf,qwen,l8}
libs=$(python3 -c "import nvidia, glob, os; print(':'.join(sorted({os.path.dirname(p) for b in nvidia.__path__ for p in glob.glob(os.path.join(b, '**', 'lib*.so*'), recursive=True)})))" 2>/dev/null)
export LD_LIBRARY_PATH="${libs}:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONUNBUFFERED=1
# Binaries and the peer script: where the device copy has them (a helper's files travel in a carried folder).
bin=${SPECULA_BIN:-.carry/bin}
hf_script=${HF_STEP_SCRIPT:-experiments/peers/hf_step.py}
save() { tar -czf "$OUT/results.tar.gz" -C "$out" .; }
has() { [[ ",$parts," == *",$1,"* ]]; }
{
  date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu --format=csv
  if has l1; then echo "== bench llama3.2-1b"; $bin/specula bench step --random-weights llama3.2-1b --out "$out"; save; fi
  if has check; then echo "== gpu_forward_check"; $bin/gpu_forward_check --quick; fi
  if has hf; then echo "== HF peer llama3.2-1b"; timeout 240 python3 "$hf_script" --shape llama3.2-1b --out "$out" --specula-json "$out/step_bench_llama3.2-1b.json"; save; fi
  if has qwen; then echo "== bench qwen2.5-coder-1.5b"; $bin/specula bench step --random-weights qwen2.5-coder-1.5b --out "$out"; save; fi
  if has l8; then echo "== bench llama3.1-8b"; $bin/specula bench step --random-weights llama3.1-8b --steps 32 --out "$out"; save; fi
  date -u
} 2>&1 | tee "$OUT/log.txt"
