#!/usr/bin/env bash
# Builds what a fused-step device call carries, here (the GPU machine has no cargo): the four binaries
# (stripped, with fused.rev naming this checkout's revision), packed as .carry/pack/bin.tar.xz, plus the
# candidate, ablation and timeline kernels from make_candidates.sh under .carry/pack/. Then, with the
# device tool:
#   run(command="mkdir -p .carry && tar -xJf .carry/pack/bin.tar.xz -C .carry && bash experiments/fused/run_fused_h200.sh PARTS",
#       carry=[".carry/pack"], timeout_s=600)
# (AB_DIR, AB_ONLY and AB_CHECK go before `bash`; run_fused_h200.sh's header lists the parts).
# Usage: experiments/fused/pack.sh [TAG]   (TAG is appended to fused.rev, e.g. s15)
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
tag=${1:-}
cargo build --release --locked --features cuda --bin specula
cargo build --release --locked -p specula-experiments --features cuda \
  --bin gpu_fused_check --bin gpu_forward_check --bin gpu_e2e_check
rm -rf .carry/bin .carry/pack
mkdir -p .carry/bin .carry/pack
for b in specula gpu_fused_check gpu_forward_check gpu_e2e_check; do
  cp "target/release/$b" .carry/bin/
  strip ".carry/bin/$b"
done
rev=$(git rev-parse HEAD)
git diff --quiet HEAD || rev="$rev+dirty"
echo "$rev${tag:++$tag}" > .carry/bin/fused.rev
tar -cJf .carry/pack/bin.tar.xz -C .carry bin
bash experiments/fused/make_candidates.sh .carry/pack/candidates > /dev/null
# The device tool carries at most 64 MiB, working tree included.
size=$(du -sb .carry/pack | cut -f1)
echo "packed $(cat .carry/bin/fused.rev): .carry/pack is $((size / 1024 / 1024)) MiB"
(( size < 56 * 1024 * 1024 )) || { echo "pack.sh: .carry/pack is over 56 MiB; the call carries at most 64 MiB with the tree" >&2; exit 1; }
ls .carry/pack .carry/pack/candidates .carry/pack/ablations
