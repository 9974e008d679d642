#!/usr/bin/env bash
# Builds the candidate kernels that wait in experiments/fused/candidates/ (README there) as .cu files for
# run_fused_h200.sh's `ab` part, here (the GPU machine may lack `patch`): each is a copy of the shipped
# kernels/cuda/fused_step.cu with patches applied and `#define` values changed.
# Usage: experiments/fused/make_candidates.sh [OUT_DIR]   (default .carry/pack/candidates; the timeline
# kernel goes to OUT_DIR/../timeline.cu, the ablation kernels to OUT_DIR/../ablations/)
# Each line of the list below: NAME, then patches (NAME.patch under candidates/) and DEFINE=VALUE edits.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:-$root/.carry/pack/candidates}
mkdir -p "$out"
# Session 31 adopted gss, headreg and tile32 (patches under ../results/fused_h100_s31/patches/). Its SASS
# reading after that (candidates/README.md): the one-pass staging's partials still in local memory (ssreg),
# the ring's barrier pointers re-loaded from local memory before every chunk's wait (ringsym), both (rss).
# Session 32: fv2_row_rms and fv2_stage went to L2 one piece after another (each piece's loads, then their
# use, in its own branch), so staging 8 rows took 11.2 us against 1.7 for one row: stg batches the loads
# and takes the one-pass staging to 8 pieces (stg8) or 4 (stg4, with smaller batches and fewer spills).
# ssreg is superseded by stg (its one-pass partials have compile-time indices).
list=(
  "ringsym ringsym"
  "stg8 stg"
  "stg4 stg FV2_ONE_PASS_PIECES=4 FV2_RMS_BATCH=4 FV2_STAGE_BATCH=2"
  "stgr stg ringsym"
)
# Ablation kernels, into OUT_DIR/../ablations (run them with AB_DIR naming it and AB_CHECK=0: their logits
# are wrong by design): the timeline kernel (timeline.patch) with ablation.patch's FV2_ABLATE bits, so that
# timeline_table.py can split each bench's step into stages. tl = the timeline kernel alone; tl_nol2pace = the
# timeline kernel without the paced L2 prefetch (adopted in session 30), to see what it moves.
ablations=(
  "tl timeline"
  "tl_nocopy timeline ablation FV2_ABLATE=1"
  "tl_nomma timeline ablation FV2_ABLATE=2"
  "tl_skeleton timeline ablation FV2_ABLATE=3"
  "tl_stream timeline ablation FV2_ABLATE=6"
  "tl_nol2pace timeline FV2_L2_LEAD=0"
)
# build DIR "NAME ITEM...": a copy of fused_step.cu with each ITEM applied in order (a patch under
# candidates/ or, failing that, beside this script, or at experiments/ITEM.patch; or a DEFINE=VALUE edit).
build() {
  local dir=$1 entry=$2 parts name dst item key value patch_file
  read -r -a parts <<< "$entry"
  name=${parts[0]}
  dst=$dir/$name.cu
  cp "$root/kernels/cuda/fused_step.cu" "$dst"
  for item in "${parts[@]:1}"; do
    if [[ $item == *=* ]]; then
      key=${item%%=*} value=${item#*=}
      grep -q "^#define $key " "$dst" || { echo "$name: no '#define $key' to change" >&2; exit 1; }
      sed -i "s/^#define $key .*/#define $key $value/" "$dst"
    else
      patch_file=$root/experiments/fused/candidates/$item.patch
      [ -f "$patch_file" ] || patch_file=$root/experiments/fused/$item.patch
      [ -f "$patch_file" ] || patch_file=$root/experiments/$item.patch
      patch -s --no-backup-if-mismatch "$dst" < "$patch_file"
    fi
  done
  echo "$dst"
}
for entry in "${list[@]}"; do build "$out" "$entry"; done
abl_dir=$(dirname "$out")/ablations
mkdir -p "$abl_dir"
for entry in "${ablations[@]}"; do build "$abl_dir" "$entry"; done
# The timeline kernels beside them, not among them (`ab` runs every .cu in OUT_DIR): the `timeline` part of
# run_fused_h200.sh runs timeline.cu, or those named in its TIMELINE_CU.
# - timeline: timeline.patch alone;
# - timeline_keys: with marks inside the attention item's keys tile (scores, exponentials, values);
# - timeline_stage: with marks inside gate/up's one-pass norm staging (activations loaded, row-sum barrier,
#   normalised and stored; slots 15 and 18 as timeline_keys.patch uses them, so not with it);
# - timeline_stage2: that kernel with a mark on entering the staging and its loads and warp sums run twice
#   (the second pass with warm code and stack; session 30's version, before gss, is under
#   ../results/fused_h100_s30/patches/);
# - timeline_stage2_rss: that kernel on rss.
timelines=(
  "timeline timeline"
  "timeline_keys timeline timeline_keys"
  "timeline_stage timeline timeline_stage"
  "timeline_stage2 timeline timeline_stage timeline_stage2"
  "timeline_stage2_rss ringsym ssreg timeline timeline_stage timeline_stage2"
)
for entry in "${timelines[@]}"; do build "$(dirname "$out")" "$entry"; done
