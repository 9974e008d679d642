#!/usr/bin/env bash
# The fused verify step (issue 6) on the lent H200, in one device call: the standard path's own parity
# check first (decoder.cu's kernels were refactored into device-function bodies for the fused kernel),
# then the fused-vs-standard-vs-CPU check, then the timing table. Logs go to $OUT (one file per part,
# written as it runs, so a cut-off call keeps what it produced).
#
# The GPU machine has no cargo: build here, then carry the stripped binaries (.carry/ is gitignored):
#   cargo build --release -p specula-experiments --features cuda --bin gpu_fused_check --bin gpu_forward_check
#   mkdir -p .carry/bin
#   for b in gpu_fused_check gpu_forward_check; do cp target/release/$b .carry/bin/ && strip .carry/bin/$b; done
#   echo "$(git rev-parse HEAD)$(git diff --quiet HEAD || echo +dirty)" > .carry/bin/fused.rev
# and with the device tool (this script is tracked, so it travels with the working tree):
#   run(command="bash experiments/fused/run_fused_h200.sh forward,check,bench", carry=[".carry/bin"], timeout_s=600)
# Parts: forward (gpu_forward_check --quick), check (gpu_fused_check --quick), check-full (without
# --quick), bench (gpu_fused_check --bench). Extra arguments after the parts go to every gpu_fused_check
# call (e.g. --no-cooperative if graph capture refuses cooperative launches).
set -uo pipefail
parts=${1:-forward,check,bench}
shift || true
extra=("$@")
out=${OUT:-/tmp/fused_out}
mkdir -p "$out"
bin=${SPECULA_BIN:-.carry/bin}
libs=$(python3 -c "import nvidia, glob, os; print(':'.join(sorted({os.path.dirname(p) for b in nvidia.__path__ for p in glob.glob(os.path.join(b, '**', 'lib*.so*'), recursive=True)})))" 2>/dev/null)
export LD_LIBRARY_PATH="${libs}:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
has() { [[ ",$parts," == *",$1,"* ]]; }
header() {
  date -u
  cat "$bin/fused.rev" 2>/dev/null
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv 2>/dev/null
}
status=0
# A deadlocked grid barrier traps after seconds (fused_step.cu watchdog); `timeout` is the last resort.
if has forward; then
  { header; timeout 300 "$bin/gpu_forward_check" --quick; echo "exit $?"; } 2>&1 | tee "$out/gpu_forward_check_h200.txt"
  grep -q "^exit 0$" "$out/gpu_forward_check_h200.txt" || status=1
fi
if has check; then
  { header; timeout 300 "$bin/gpu_fused_check" --quick ${extra[@]+"${extra[@]}"}; echo "exit $?"; } 2>&1 | tee "$out/gpu_fused_check_h200.txt"
  grep -q "^exit 0$" "$out/gpu_fused_check_h200.txt" || status=1
fi
if has check-full; then
  { header; timeout 500 "$bin/gpu_fused_check" ${extra[@]+"${extra[@]}"}; echo "exit $?"; } 2>&1 | tee "$out/gpu_fused_check_full_h200.txt"
  grep -q "^exit 0$" "$out/gpu_fused_check_full_h200.txt" || status=1
fi
if has bench; then
  { header; timeout 300 "$bin/gpu_fused_check" --bench ${extra[@]+"${extra[@]}"}; echo "exit $?"; } 2>&1 | tee "$out/gpu_fused_bench_h200.txt"
  grep -q "^exit 0$" "$out/gpu_fused_bench_h200.txt" || status=1
fi
exit $status
