#!/usr/bin/env bash
# Acceptance sweep of the real Qwen2.5-Coder pair on the CPU (issue 4, must-show 1): draft model and n-gram
# drafters x k {3,5,7} x T {0 greedy, 1 standard} on humaneval, mbpp, gsm8k, mt-bench (20 prompts each,
# 128 new tokens). Resumable: rerun the same command after an interruption.
# Usage: experiments/run_qwen_pair_acceptance.sh [MODELS_DIR] [OUT_DIR] [extra specula flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
M=${1:-$HOME/.cache/specula/models}
OUT=${2:-experiments/results/qwen_pair_acceptance}
shift $(( $# < 2 ? $# : 2 ))
D=../shared/data/eval_datasets
# Every session of this sweep so far ran the AVX2 kernel (AVX-512 rounds differently; 1.16x faster on the
# 8-token verify, NOTES v0.4b): keep one arithmetic across resumed sessions unless told otherwise.
export SPECULA_CPU_KERNEL=${SPECULA_CPU_KERNEL:-avx2}
cargo build --release --locked -q
exec ./target/release/specula experiment acceptance \
  --target "$M/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf" \
  --drafters "draft_model:$M/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf,ngram" \
  --draft-lengths 3,5,7 --temperatures 0,1 --rules greedy,standard \
  --prompts $D/humaneval.jsonl --prompts $D/mbpp.jsonl --prompts $D/gsm8k.jsonl --prompts $D/mt-bench.jsonl \
  --num-prompts 20 --max-new-tokens 128 --chat auto --seed 0 --batch-size 4 \
  --out "$OUT" "$@"
