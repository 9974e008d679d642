#!/usr/bin/env bash
# The fused verify step (issue 6) on the lent H200, in one device call: the standard path's own parity
# check first (decoder.cu's kernels were refactored into device-function bodies for the fused kernel),
# then the fused-vs-standard-vs-CPU check, then the timing table. Logs go to $OUT (one file per part,
# written as it runs, so a cut-off call keeps what it produced).
#
# The GPU machine has no cargo: build here with experiments/fused/pack.sh (the stripped binaries and the
# candidate kernels, packed under .carry/pack, which is gitignored), then with the device tool (this script
# is tracked, so it travels with the working tree):
#   run(command="mkdir -p .carry && tar -xJf .carry/pack/bin.tar.xz -C .carry && bash experiments/fused/run_fused_h200.sh check,bench,engine,step,e2e",
#       carry=[".carry/pack"], timeout_s=600)
# Parts: forward (gpu_forward_check --quick), check (gpu_fused_check --quick: parity, then the distribution
# test of speculative sampling through both backends), check-full (without
# --quick), bench (gpu_fused_check --bench, with the in-kernel profile), engine (gpu_e2e_check: the
# engine on both decode backends; needs SPECULA_DEFAULT_MODELS or the repository's models/), step
# (`specula bench step --backends standard,latency_specialized`, llama3.2-1b), shapes (the same for
# qwen2.5-coder-1.5b and llama3.1-8b), e2e (`specula bench e2e`, 1 request, synthetic 3.78, k=7, once per
# latency_specialized shape policy in $E2E_SHAPES, default "measured all"), e2e-long (the same at a 4000-token
# prompt, measured policy only: 256 new tokens cross from the 4096-key context bucket into the 8192 one,
# so each bucket's timings are in its report),
# rows16 (`bench step` at 2 x 8 with v2's row limit at 8 and at 16, the engine's default since session 32:
# v1 against v2 at 16 rows, llama3.2-1b and llama3.1-8b),
# ab (candidate kernels: every NAME.cu under $AB_DIR, default .carry/pack/candidates, or those named in
# $AB_ONLY (space-separated), loaded through
# SPECULA_FUSED_STEP_CU: first `gpu_fused_check --quick` for every candidate (AB_CHECK=0: none; AB_CHECK="a b":
# only those candidates' checks), then `gpu_fused_check --bench --short --v2-profile` for the shipped kernel
# (not with AB_BASELINE=0) and every candidate (the bench itself compares each kernel's logits with the
# standard step's at every shape); logs in $OUT/ab/, a summary table in $OUT/ab/summary.txt). Make the candidates here, where `patch` is known to exist:
# experiments/fused/make_candidates.sh (its list says which patches and #define edits make each).
# abx (ab in one bench process: `gpu_fused_check --bench --short --v2-kernels` with the same candidates,
# AB_ONLY and AB_CHECK; each shape timed with the shipped kernel and every candidate in turn; the
# checks first; $OUT/abx/bench_abx.txt, check_NAME.txt and summary.txt).
# producer (`gpu_fused_check --bench --short --v2-producer $PRODUCER`, default
# "2,3,4,2::2000,:::4,2:::4,::::8,2::::8,:::4:16,2:::4:16": v2 with other producer settings, IN[:L2[:PACE[:LEAD[:ROWS]]]]
# each (FusedOptions::copies_in_flight, l2_copies_in_flight, l2_prefetch_interval, l2_prefetch_lead,
# l2_prefetch_max_rows; an empty field keeps the kernel's default), timed beside the default v2 step at
# every shape in one process, no recompiles; the bench fails if any setting's logits differ from the
# default's; ~3 minutes on an H200; $OUT/producer.txt).
# timeline (the one-layer timeline kernel, .carry/pack/timeline.cu from make_candidates.sh, or the kernels
# $TIMELINE_CU names, through SPECULA_FUSED_STEP_CU; its table by timeline_table.py in $OUT/timeline.txt,
# then each CTA's gate/up and down times with its SM and tile count and the attention item's steps, from
# --v2-profile-cta).
# ring (experiments/fused/ringbench/ring_stream.cu, built there with nvcc: how fast a ring of bulk copies,
# one CTA per SM, streams bursts of weights between grid barriers, against the plain read bandwidth, then
# the same ring in the fused step's CTA shape; RING_ARGS=kernel runs only the latter and one baseline;
# $OUT/ring_stream.txt).
# l2lat (experiments/fused/ringbench/l2_latency.cu, built there with nvcc: one dependent L2 load's latency
# on each SM while the SMs stream weights as the fused step does, with the streaming and the loads on the
# same SMs or on different ones; $OUT/l2_latency.txt).
# fence (experiments/fused/ringbench/fence_cost.cu, built there with nvcc: what one counter hop's release
# costs, thread 0's atom.add.release.gpu and the other publishing patterns, while the SMs stream weights as
# the fused step does, the streaming and the releases on the same SMs or on different ones;
# $OUT/fence_cost.txt).
# share (experiments/fused/ringbench/stage_share.cu, built there with nvcc for sm_90a: one activation
# staging of 1, 8 or 16 rows by every CTA at once after a grid barrier, with and without the weight stream,
# in the shipped order, rotated (candidate rot), as bulk copies, and multicast within clusters of 2 and 4;
# $OUT/stage_share.txt).
# wide (experiments/fused/ringbench/wide_stage.cu, built there with nvcc: one GEMM stage of 16, 32 or 64
# rows alone, in several splits of tiles and K over the CTAs, against the plain read bandwidth, each checked
# against a reference product; $OUT/wide_stage.txt).
# STEP_ARGS (e.g. "--fused-producer 2") goes to step's and shapes' `bench step` calls; with
# SPECULA_FUSED_STEP_CU naming a candidate under .carry/pack/candidates, step runs the issue's table with
# that kernel and setting without a new pack (the report names both).
# step/shapes/e2e results go into $OUT/bench.tgz (the device tool returns at most 8 files). Extra
# arguments after the parts go to every gpu_fused_check call (e.g. --no-cooperative).
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
if has ab; then
  mkdir -p "$out/ab"
  ab_dir=${AB_DIR:-.carry/pack/candidates}
  ls "$ab_dir"/*.cu > /dev/null 2>&1 || { echo "ab: no candidate .cu files under $ab_dir" | tee "$out/ab/summary.txt"; status=1; }
  # The candidates this call runs, as absolute paths (AB_ONLY="a b": only those, so one pack can be split
  # over several calls of the 600 s limit).
  ab_srcs=()
  for src in "$ab_dir"/*.cu; do
    [ -f "$src" ] || continue
    name=$(basename "$src" .cu)
    if [[ -n ${AB_ONLY:-} && " $AB_ONLY " != *" $name "* ]]; then continue; fi
    ab_srcs+=("$(cd "$(dirname "$src")" && pwd)/$(basename "$src")")
  done
  # The checks first (AB_CHECK: 1 checks every candidate, 0 none, otherwise the names it lists): a
  # candidate is adopted only after its check, so a call cut short by the time limit, or by the device
  # time left, should lose benches rather than the check.
  ab_check=${AB_CHECK:-1}
  for src in ${ab_srcs[@]+"${ab_srcs[@]}"}; do
    name=$(basename "$src" .cu)
    if [[ $ab_check == 1 || ( $ab_check != 0 && " $ab_check " == *" $name "* ) ]]; then
      { header; SPECULA_FUSED_STEP_CU=$src timeout 300 "$bin/gpu_fused_check" --quick; echo "exit $?"; } > "$out/ab/check_$name.txt" 2>&1
      grep -q "^exit 0$" "$out/ab/check_$name.txt" || status=1
    fi
  done
  # AB_BASELINE=0 skips the shipped kernel's bench (a call with too little device time for two benches);
  # the summary's standard column then comes from the first candidate's own bench, and a comparison with
  # the shipped kernel is only as good as the fused/standard ratios of two processes.
  if [[ ${AB_BASELINE:-1} != 0 ]]; then
    { header; timeout 200 "$bin/gpu_fused_check" --bench --short --v2-profile; echo "exit $?"; } > "$out/ab/bench_shipped.txt" 2>&1
  fi
  for src in ${ab_srcs[@]+"${ab_srcs[@]}"}; do
    name=$(basename "$src" .cu)
    { header; SPECULA_FUSED_STEP_CU=$src timeout 200 "$bin/gpu_fused_check" --bench --short --v2-profile; echo "exit $?"; } > "$out/ab/bench_$name.txt" 2>&1
  done
  # Fused median ms per shape, one column per kernel; and each candidate's parity verdict.
  python3 - "$out/ab" > "$out/ab/summary.txt" <<'PY'
import glob, os, re, sys
d = sys.argv[1]
cols, table = [], {}
for f in sorted(glob.glob(os.path.join(d, "bench_*.txt")), key=lambda f: (not f.endswith("bench_shipped.txt"), f)):
    name = os.path.basename(f)[6:-4]
    cols.append(name)
    for line in open(f):
        # | b | t | standard | fused (v1) | fused v2 | ...: medians of the first three variants.
        m = re.match(r"^\| (\d+) \| (\d+) \| ([\d.]+) \([\d.]+\) \| ([\d.]+) \([\d.]+\) \| ([\d.]+) \(", line)
        if m:
            # The standard step's time from the shipped kernel's bench (the first file).
            table.setdefault((int(m[1]), int(m[2])), {}).setdefault("standard", m[3])
            table[(int(m[1]), int(m[2]))][name] = (m[4], m[5])
print("| requests x tokens | standard | " + " | ".join(f"{c} v1 | {c} v2" for c in cols) + " |")
print("|---|---:|" + "---:|---:|" * len(cols))
for (b, t), row in sorted(table.items()):
    print(f"| {b} x {t} | {row.get('standard', '-')} | " + " | ".join(" | ".join(row.get(c, ("-", "-"))) for c in cols) + " |")
for f in sorted(glob.glob(os.path.join(d, "check_*.txt"))):
    tail = [l.strip() for l in open(f) if "worst relative error" in l or l.startswith("exit")]
    print(os.path.basename(f)[6:-4] + ": " + "; ".join(tail))
PY
  cat "$out/ab/summary.txt"
fi
if has producer; then
  { header; timeout 400 "$bin/gpu_fused_check" --bench --short --v2-producer "${PRODUCER:-2,3,4,2::2000,:::4,2:::4,::::8,2::::8,:::4:16,2:::4:16}" ${extra[@]+"${extra[@]}"}; echo "exit $?"; } > "$out/producer.txt" 2>&1
  grep -q "^exit 0$" "$out/producer.txt" || status=1
  # The summary table (the bench's last table) and the verdict on the logits.
  sed -n '/^llama3.2-1b, /,$p' "$out/producer.txt"
fi
if has abx; then
  # ab's candidates in ONE bench process (gpu_fused_check --v2-kernels): each shape timed with the shipped
  # kernel and every candidate in turn, one tuning and one standard step for all; the checks as ab's.
  mkdir -p "$out/abx"
  ab_dir=${AB_DIR:-.carry/pack/candidates}
  abx_srcs=()
  for src in "$ab_dir"/*.cu; do
    [ -f "$src" ] || continue
    name=$(basename "$src" .cu)
    if [[ -n ${AB_ONLY:-} && " $AB_ONLY " != *" $name "* ]]; then continue; fi
    abx_srcs+=("$src")
  done
  ab_check=${AB_CHECK:-1}
  # A candidate whose check fails is left out of the bench: the bench runs every kernel in one process,
  # and a kernel that traps (a deadlock's watchdog, a bad address) leaves the CUDA context unusable, which
  # would cost every other candidate's numbers.
  benched=()
  failed=()
  for src in ${abx_srcs[@]+"${abx_srcs[@]}"}; do
    name=$(basename "$src" .cu)
    if [[ $ab_check == 1 || ( $ab_check != 0 && " $ab_check " == *" $name "* ) ]]; then
      { header; SPECULA_FUSED_STEP_CU=$(cd "$(dirname "$src")" && pwd)/$(basename "$src") timeout 300 "$bin/gpu_fused_check" --quick; echo "exit $?"; } > "$out/abx/check_$name.txt" 2>&1
      if ! grep -q "^exit 0$" "$out/abx/check_$name.txt"; then
        status=1
        failed+=("$name")
        continue
      fi
    fi
    benched+=("$src")
  done
  abx_srcs=(${benched[@]+"${benched[@]}"})
  list=$(IFS=,; echo "${abx_srcs[*]}")
  { header; timeout 500 "$bin/gpu_fused_check" --bench --short ${list:+--v2-kernels "$list"} ${extra[@]+"${extra[@]}"}; echo "exit $?"; } > "$out/abx/bench_abx.txt" 2>&1
  grep -q "^exit 0$" "$out/abx/bench_abx.txt" || status=1
  { sed -n '/^llama3.2-1b, /,$p' "$out/abx/bench_abx.txt"
    for f in "$out"/abx/check_*.txt; do [ -f "$f" ] && echo "$(basename "$f" .txt): $(grep -E "worst relative error|^exit" "$f" | tr '\n' ' ')"; done
    for name in ${failed[@]+"${failed[@]}"}; do echo "$name: its check failed, so it was not benched"; done
  } > "$out/abx/summary.txt"
  cat "$out/abx/summary.txt"
fi
if has timeline; then
  # The one-layer timeline (timeline.patch, made by make_candidates.sh), then its table. TIMELINE_CU may
  # name several kernels (space-separated, e.g. the timeline kernel and an ablation kernel built on it):
  # each gets its own bench_timeline_NAME.txt and timeline_NAME.txt (one kernel: no suffix).
  tls=(${TIMELINE_CU:-.carry/pack/timeline.cu})
  for tl in "${tls[@]}"; do
    suffix=""
    [ ${#tls[@]} -gt 1 ] && suffix="_$(basename "$tl" .cu)"
    if [ -f "$tl" ]; then
      tl=$(cd "$(dirname "$tl")" && pwd)/$(basename "$tl")
      { header; SPECULA_FUSED_STEP_CU=$tl timeout 200 "$bin/gpu_fused_check" --bench --short --v2-profile-cta; echo "exit $?"; } > "$out/bench_timeline$suffix.txt" 2>&1
      grep -q "^exit 0$" "$out/bench_timeline$suffix.txt" || status=1
      { python3 "$(dirname "$0")/timeline_table.py" "$out/bench_timeline$suffix.txt"
        python3 "$(dirname "$0")/timeline_table.py" --per-cta "$out/bench_timeline$suffix.txt"; } | tee "$out/timeline$suffix.txt"
    else
      echo "timeline: no $tl (experiments/fused/make_candidates.sh makes it)" | tee "$out/timeline$suffix.txt"; status=1
    fi
  done
fi
# A ringbench program (experiments/fused/ringbench/NAME.cu) built here with nvcc for ARCH_FLAGS and run under
# a TIMEOUT, its log in $OUT/NAME.txt; further arguments go to the program.
ringbench() {
  local name=$1 arch=$2 limit=$3
  shift 3
  local nvcc_bin
  nvcc_bin=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
  # shellcheck disable=SC2086  # ARCH_FLAGS is several words
  { header; "$nvcc_bin" -O3 -std=c++17 $arch -o "/tmp/$name" "$(dirname "$0")/ringbench/$name.cu" &&
    timeout "$limit" "/tmp/$name" "$@"; echo "exit $?"; } 2>&1 | tee "$out/$name.txt"
  grep -q "^exit 0$" "$out/$name.txt" || status=1
}
# shellcheck disable=SC2086  # RING_ARGS is several words
if has ring; then ringbench ring_stream -arch=sm_90 200 ${RING_ARGS:-}; fi
if has l2lat; then ringbench l2_latency -arch=sm_90 120; fi
if has fence; then ringbench fence_cost -arch=sm_90 120; fi
# sm_90a: ptxas advises the multicast copy there rather than on sm_90.
if has share; then ringbench stage_share "-gencode arch=compute_90a,code=sm_90a" 120; fi
if has wide; then ringbench wide_stage -arch=sm_90 200; fi
export SPECULA_DEFAULT_MODELS=${SPECULA_DEFAULT_MODELS:-$PWD/models/default}
export SPECULA_GIT_REVISION=${SPECULA_GIT_REVISION:-$(cat "$bin/fused.rev" 2>/dev/null)}
res=/tmp/fused_bench; mkdir -p "$res"
pack() { tar -czf "$out/bench.tgz" -C "$res" .; }
if has engine; then
  { header; timeout 300 "$bin/gpu_e2e_check" --root "$PWD"; echo "exit $?"; } 2>&1 | tee "$out/gpu_e2e_check_h200.txt"
  grep -q "^exit 0$" "$out/gpu_e2e_check_h200.txt" || status=1
fi
if has step; then
  timeout 300 "$bin/specula" bench step --random-weights llama3.2-1b --backends standard,latency_specialized --out "$res" ${STEP_ARGS:-} 2>&1 | tee "$res/step_llama3.2-1b.txt" | tail -14 || status=1; pack
fi
if has shapes; then
  timeout 200 "$bin/specula" bench step --random-weights qwen2.5-coder-1.5b --backends standard,latency_specialized --out "$res" ${STEP_ARGS:-} 2>&1 | tee "$res/step_qwen.txt" | tail -14 || status=1; pack
  timeout 300 "$bin/specula" bench step --random-weights llama3.1-8b --backends standard,latency_specialized --steps 32 --out "$res" ${STEP_ARGS:-} 2>&1 | tee "$res/step_l8.txt" | tail -14 || status=1; pack
fi
if has rows16; then
  # v1 against v2 at 16 rows (2 requests x 8 tokens), in the same harness: v2's row limit
  # (FusedOptions::dataflow_max_rows) at 8 and at 16 (the default since session 32). llama3.2-1b and
  # llama3.1-8b (G = 4: 32 query vectors per sequence, within v2's limit); qwen2.5-coder-1.5b's 48 keep it
  # on v1.
  for m in llama3.2-1b llama3.1-8b; do
    for r in 8 16; do
      mkdir -p "$res/rows16_${m}_$r"
      timeout 200 "$bin/specula" bench step --random-weights "$m" --backends standard,latency_specialized --batches 2 --tokens 8 --fused-dataflow-max-rows "$r" --steps 32 --out "$res/rows16_${m}_$r" 2>&1 | tee "$res/rows16_${m}_$r/step.txt" | tail -4 || status=1; pack
    done
  done
fi
if has e2e; then
  # Both of latency_specialized's shape policies: measured (the engine's default: fused only where its
  # first step timed faster) and all (every shape the kernel takes).
  for shapes in ${E2E_SHAPES:-measured all}; do
    mkdir -p "$res/e2e_$shapes"
    timeout 200 "$bin/specula" bench e2e --random-weights llama3.2-1b --backends standard,latency_specialized --specialized-shapes "$shapes" --drafter draft-random --requests 1 --k 7 --acceptance-length 3.78 --out "$res/e2e_$shapes" 2>&1 | tee "$res/e2e_$shapes/e2e_llama3.2-1b.txt" | tail -6 || status=1; pack
  done
fi
if has e2e-long; then
  mkdir -p "$res/e2e_long"
  timeout 300 "$bin/specula" bench e2e --random-weights llama3.2-1b --backends standard,latency_specialized --specialized-shapes measured --drafter draft-random --requests 1 --k 7 --acceptance-length 3.78 --context 4000 --out "$res/e2e_long" 2>&1 | tee "$res/e2e_long/e2e_llama3.2-1b.txt" | tail -12 || status=1; pack
fi
exit $status
