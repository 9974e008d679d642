#!/usr/bin/env bash
# The DSpark drafter on the lent H200 in one device call (issue 8): gpu_dspark_check (parity with the
# CPU drafter, greedy speculation = plain greedy, proposal timing with CUDA graphs on and off and the
# Markov kernel alone), optionally the same check with another dspark.cu loaded through
# SPECULA_DSPARK_CU (an A/B of the Markov kernel; file .carry/bin/dspark_old.cu if present), the
# drafter-cost comparison with the draft model (experiments/run_gpu_drafter_cost_h200.sh, PROMPTS
# prompts; DRAFT_KS="3 5 7" adds the draft model at k = 3 and 5; with COST_AB=1 once more with the other
# dspark.cu), and the engine check (gpu_e2e_check). Binaries built here and packed as
# experiments/fused/run_fused_h200.sh describes; the DeepSpec fixture travels as .carry/fixtures:
#   run(command="mkdir -p .carry && tar -xJf .carry/pack/bin.tar.xz -C .carry && OUT=$OUT bash experiments/run_gpu_dspark_h200.sh",
#       carry=[".carry/pack", ".carry/fixtures"], timeout_s=600)
# Writes $OUT/gpu_dspark_check.txt (and _ab.txt), $OUT/drafter_cost.txt + drafter_cost_runs.tgz,
# $OUT/gpu_e2e_check_h200.txt; prints the timing tables last.
set -uo pipefail
out=${OUT:-/tmp/dspark_out}
mkdir -p "$out"
bin=${SPECULA_BIN:-.carry/bin}
libs=$(python3 -c "import nvidia, glob, os; print(':'.join(sorted({os.path.dirname(p) for b in nvidia.__path__ for p in glob.glob(os.path.join(b, '**', 'lib*.so*'), recursive=True)})))" 2>/dev/null)
export LD_LIBRARY_PATH="${libs}:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fixture=${FIXTURE:-$PWD/.carry/fixtures/dspark-deepspec}
header() { date -u; cat "$bin/fused.rev" 2>/dev/null; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null; }
{ header; timeout 240 "$bin/gpu_dspark_check" --root "$PWD" --fixture "$fixture" --reps 50; echo "exit $?"; } > "$out/gpu_dspark_check.txt" 2>&1
if [ -f "$bin/dspark_old.cu" ]; then
  { header; echo "SPECULA_DSPARK_CU=$bin/dspark_old.cu"; SPECULA_DSPARK_CU="$bin/dspark_old.cu" timeout 240 "$bin/gpu_dspark_check" --root "$PWD" --fixture "$fixture" --reps 50; echo "exit $?"; } > "$out/gpu_dspark_check_ab.txt" 2>&1
fi
# Candidate Markov kernels (experiments/dspark/candidates/*.patch applied to kernels/cuda/dspark.cu here:
#   mkdir -p .carry/pack/dspark_candidates; for p in experiments/dspark/candidates/*.patch; do
#     c=.carry/pack/dspark_candidates/$(basename "$p" .patch).cu; cp kernels/cuda/dspark.cu "$c"; patch -s "$c" < "$p"; done
# ), each through SPECULA_DSPARK_CU with --reps 20; one file per candidate; ONLY_CANDIDATES=1 stops after them.
for c in ${DSPARK_AB_DIR:-.carry/pack/dspark_candidates}/*.cu; do
  [ -f "$c" ] || continue
  name=$(basename "$c" .cu)
  { header; echo "SPECULA_DSPARK_CU=$c"; SPECULA_DSPARK_CU="$c" timeout 120 "$bin/gpu_dspark_check" --root "$PWD" --fixture "$fixture" --reps 20; echo "exit $?"; } > "$out/candidate_$name.txt" 2>&1
  echo "== candidate $name"; grep -A12 "^summary" "$out/candidate_$name.txt"; grep "FAIL\|^exit" "$out/candidate_$name.txt" | head -5
done
[ -n "${ONLY_CANDIDATES:-}" ] && exit 0
mkdir -p "$out/runs"
# COST_TIMEOUT (s) caps the comparison so that the runs finished so far still come back (prompts are the
# outer loop: a cut run keeps whole prompts; experiments/drafter_cost_table.py tables them here).
timeout "${COST_TIMEOUT:-1800}" env PROMPTS=${PROMPTS:-20} OUT="$out/runs" bash experiments/run_gpu_drafter_cost_h200.sh > "$out/drafter_cost.txt" 2>&1
tar -czf "$out/drafter_cost_runs.tgz" -C "$out" runs && rm -rf "$out/runs"
if [ -f "$bin/dspark_old.cu" ] && [ -n "${COST_AB:-}" ]; then
  mkdir -p "$out/runs"
  SPECULA_DSPARK_CU="$bin/dspark_old.cu" PROMPTS=${PROMPTS:-20} OUT="$out/runs" bash experiments/run_gpu_drafter_cost_h200.sh > "$out/drafter_cost_ab.txt" 2>&1
  tar -czf "$out/drafter_cost_ab_runs.tgz" -C "$out" runs && rm -rf "$out/runs"
fi
if [ -z "${SKIP_ENGINE:-}" ]; then
  { header; timeout 300 "$bin/gpu_e2e_check" --root "$PWD"; echo "exit $?"; } > "$out/gpu_e2e_check_h200.txt" 2>&1
  tail -2 "$out/gpu_e2e_check_h200.txt"
fi
for f in gpu_dspark_check.txt gpu_dspark_check_ab.txt; do
  [ -f "$out/$f" ] && { echo "== $f"; grep -A12 "^summary" "$out/$f"; grep "FAIL\|^exit" "$out/$f" | head -12; }
done
tail -12 "$out/drafter_cost.txt"
[ -f "$out/drafter_cost_ab.txt" ] && { echo "== drafter cost with SPECULA_DSPARK_CU=$bin/dspark_old.cu"; tail -12 "$out/drafter_cost_ab.txt"; }
