#!/usr/bin/env bash
# Packs what run_h200.sh needs from ../shared (not on the GPU machine) into .carry/dspark-train/ (gitignored),
# about 3.6 MB: the DeepSpec parity fixture (1.6 MB), the two corpora xz-compressed (1.9 MB; data.py's split is
# taken on the device after decompressing), and the first 20 lines of the four eval prompt sets that the Rust
# acceptance runs use (the held-back set is in the repo: experiments/prompts/heldback.jsonl).
#
#   bash experiments/train_dspark/make_carry.sh [SHARED_DIR]      (from the repo root; default ../shared)
set -euo pipefail
shared=${1:-../shared}
dst=.carry/dspark-train
rm -rf "$dst"
mkdir -p "$dst/fixture" "$dst/corpora" "$dst/eval_datasets"
cp "$shared"/fixtures/dspark-deepspec/* "$dst/fixture/"
for f in python-stdlib-3.11.txt tinyshakespeare.txt; do
    xz -9 -T1 -c "$shared/data/corpora/$f" > "$dst/corpora/$f.xz"
done
cp "$shared/data/corpora/NOTICE" "$dst/corpora/"
for f in humaneval mbpp gsm8k mt-bench; do
    head -n 20 "$shared/data/eval_datasets/$f.jsonl" > "$dst/eval_datasets/$f.jsonl"
done
cp "$shared/data/eval_datasets/LICENSE-DeepSpec" "$dst/eval_datasets/"
( cd "$dst" && find . -type f | sort | xargs sha256sum ) > "$dst.sha256"
mv "$dst.sha256" "$dst/SHA256SUMS"
du -sh "$dst"
