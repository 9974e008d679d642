#!/usr/bin/env bash
# Builds the candidate kernels that wait in experiments/fused/candidates/ (README there) as .cu files for
# run_fused_h200.sh's `ab` part, here (the GPU machine may lack `patch`): each is a copy of the shipped
# kernels/cuda/fused_step.cu with patches applied and `#define` values changed.
# Usage: experiments/fused/make_candidates.sh [OUT_DIR]   (default .carry/pack/candidates; the timeline
# kernel goes to OUT_DIR/../timeline.cu)
# Each line of the list below: NAME, then patches (NAME.patch under candidates/) and DEFINE=VALUE edits.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:-$root/.carry/pack/candidates}
mkdir -p "$out"
list=(
  "noprof FUSED_PROFILING=0"
  "combine combine"
  "attn_vbg attn_vbg"
  "onepass8 onepass8"
  "epi epi_swizzle"
  "ringidx ringidx"
  "cv combine attn_vbg"
  "allnew combine attn_vbg onepass8 epi_swizzle ringidx"
  "allnew_noprof combine attn_vbg onepass8 epi_swizzle ringidx FUSED_PROFILING=0"
)
for entry in "${list[@]}"; do
  read -r -a parts <<< "$entry"
  name=${parts[0]}
  dst=$out/$name.cu
  cp "$root/kernels/cuda/fused_step.cu" "$dst"
  for item in "${parts[@]:1}"; do
    if [[ $item == *=* ]]; then
      key=${item%%=*} value=${item#*=}
      grep -q "^#define $key " "$dst" || { echo "$name: no '#define $key' to change" >&2; exit 1; }
      sed -i "s/^#define $key .*/#define $key $value/" "$dst"
    else
      patch -s --no-backup-if-mismatch "$dst" < "$root/experiments/fused/candidates/$item.patch"
    fi
  done
  echo "$dst"
done
# The timeline kernel (timeline.patch) beside them, not among them (`ab` runs every .cu in OUT_DIR): the
# `timeline` part of run_fused_h200.sh runs it.
timeline=$(dirname "$out")/timeline.cu
cp "$root/kernels/cuda/fused_step.cu" "$timeline"
patch -s --no-backup-if-mismatch "$timeline" < "$root/experiments/fused/timeline.patch"
echo "$timeline"
