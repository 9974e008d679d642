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
# Session 32 adopted stg4 (the norm staging's loads batched; patch under ../results/fused_h200_s32/patches/),
# session 33 rowrope (an attention item's RoPE angles once per row at k = 7; ../results/fused_h100_s33/patches/),
# session 34 opg1 (the grouped norm staging beyond 4 pieces; ../results/fused_h100_s34/patches/, with opg).
# Waiting: dcomb (the attention combine spread over a (sequence, KV head)'s items when the step's items
# run in one round), relacq (the split counter's fences as one acq_rel add), dcra (both), kt64 (the keys
# tile with head_dim 64 as a constant), dcrk (dcra + kt64), hfreq (a head's RoPE frequencies loaded with
# its values), dcrkh (dcrk + hfreq); p1 (each 64 KB slot as one copy, so 64 KB in flight in one copy
# instead of two 32 KB ones; for the H200). Session 34's if2 / if3 / if2p define edits are now launch
# settings (FusedOptions::copies_in_flight etc.), timed in one process by run_fused_h200.sh's `producer`;
# capconst (session 35: the kernel before the producer settings came from the launch flags, i.e. the
# caps and the prefetch interval as compile-time constants: an A/B of that change, whose SASS differs);
# qkvrope (session 36: RoPE, q's scale and the KV append in the QKV stage's epilogue, its tiles taken in
# RoPE-pair order; the attention item only copies its head vectors), dcrkq (dcrk + qkvrope); xnorm (the
# norm stages after layer 0 staged from bf16(norm weight * x) rows and tile sums of squares that the O and
# down epilogues write, 1 / rms applied in the epilogue), xq (xnorm + qkvrope: xq.patch after xnorm.patch),
# xdcrkq (xq + dcomb + dcra + kt64); poll4 / poll2 (a stage counter polled by 4 or 2 staggered lanes);
# rot (each CTA's cp.async staging starts at its own line of the rows: O and down, and with xnorm every
# norm stage but layer 0's), xrot (xnorm + rot: xrot.patch after xnorm.patch), xqrot (xq + rot), xdcrkqr
# (xdcrkq + rot); xmc2 / xmc4 (xnorm with its whole-K stagings copied once per thread-block cluster of 2 or
# 4 CTAs, multicast: xmc2.patch after xnorm.patch; needs the host's cluster launch, session 36), xmc2r
# (xmc2 + rot for the down stage's per-chunk copies);
# candidates/README.md.
list=(
  "dcomb dcomb"
  "relacq relacq"
  "dcra dcomb dcra"
  "kt64 kt64"
  "dcrk dcomb dcra kt64"
  "hfreq hfreq"
  "dcrkh dcomb dcra kt64 hfreq"
  "p1 FV2_PARTS=1"
  "capconst capconst"
  "qkvrope qkvrope"
  "dcrkq dcomb dcra kt64 qkvrope"
  "xnorm xnorm"
  "xq xnorm xq"
  "xdcrkq xnorm xq dcomb dcra kt64"
  "poll4 poll4"
  "poll2 poll4 FV2_POLLERS=2"
  "rot rot"
  "xrot xnorm xrot"
  "xqrot xnorm xq xrot"
  "xdcrkqr xnorm xq dcomb dcra kt64 xrot"
  "xmc2 xnorm xmc2"
  "xmc4 xnorm xmc2 FV2_CLUSTER=4"
  "xmc2r xnorm xmc2 xrot"
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
# - timeline_stage: with marks inside gate/up's norm staging (one-pass: activations loaded, row-sum
#   barrier, normalised and stored; two-pass: row sums, inv_rms barrier, normalised and stored; slots 15,
#   18 and 22, 15 and 18 as timeline_keys.patch uses them, so not with it). Rewritten in session 32 for the
#   batched staging; session 31's timeline_stage2 is under ../results/fused_h100_s31/patches/.
timelines=(
  "timeline timeline"
  "timeline_keys timeline timeline_keys"
  "timeline_stage timeline timeline_stage"
)
for entry in "${timelines[@]}"; do build "$(dirname "$out")" "$entry"; done
