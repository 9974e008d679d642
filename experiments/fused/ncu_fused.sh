#!/usr/bin/env bash
# Nsight Compute on the fused v2 kernel (issue 6), on the lent H200: one launch at 1 x 1 (the bench's
# first shape), llama3.2-1b shape with random weights, 256 cached positions. The H200's runtime
# (Firecracker) lets ncu read the hardware counters; the clocks are left alone (--clock-control none,
# the device notes' METHOD.md). Writes to $OUT: the report, its details page (warp stall reasons, memory
# and pipe throughputs) and the per-SASS-instruction source page (stall samples per instruction) as CSV.
# Usage (binaries packed as for run_fused_h200.sh):
#   run(command="mkdir -p .carry && tar -xJf .carry/pack/bin.tar.xz -C .carry && bash experiments/fused/ncu_fused.sh [kernel regex] [launch skip]", carry=[".carry/pack"])
set -uo pipefail
kernel=${1:-fused_forward_v2_m8}
skip=${2:-2}
out=${OUT:-/tmp/ncu_out}
mkdir -p "$out"
bin=${SPECULA_BIN:-.carry/bin}
libs=$(python3 -c "import nvidia, glob, os; print(':'.join(sorted({os.path.dirname(p) for b in nvidia.__path__ for p in glob.glob(os.path.join(b, '**', 'lib*.so*'), recursive=True)})))" 2>/dev/null)
export LD_LIBRARY_PATH="${libs}:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1 || ls /usr/local/cuda/bin/ncu)
{ date -u; cat "$bin/fused.rev"; "$ncu" --version | tail -1; } | tee "$out/ncu_header.txt"
timeout 400 "$ncu" --clock-control none --set full --import-source no -k "regex:$kernel" --launch-skip "$skip" \
  --launch-count 1 -o "$out/fused_v2" -f "$bin/gpu_fused_check" --bench --short --samples 3 > "$out/ncu_run.txt" 2>&1
echo "ncu exit $?" | tee -a "$out/ncu_run.txt"
"$ncu" --import "$out/fused_v2.ncu-rep" --page details > "$out/details.txt" 2>&1
"$ncu" --import "$out/fused_v2.ncu-rep" --page source --print-source sass --csv > "$out/source_sass.csv" 2>&1
gzip -f "$out/source_sass.csv"
"$ncu" --import "$out/fused_v2.ncu-rep" --page raw > "$out/raw.txt" 2>&1
# Warp stall reasons: average warps stalled per issued instruction, by reason (largest first).
grep -E "smsp__average_warps_issue_stalled_.*_per_issue_active.ratio" "$out/raw.txt" | sort -k3 -g -r | head -14 | tee "$out/stalls.txt"
# The warp stall reasons (share of samples), the headline of the details page.
grep -E "Duration|Memory Throughput|DRAM Throughput|L2 Hit|Shared|Warp Cycles Per Issued|Issue Slots|No Eligible|Active Warps|Stall|stall" "$out/details.txt" | head -60
