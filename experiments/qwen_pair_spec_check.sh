#!/usr/bin/env bash
# Greedy speculative output vs plain output on the real Qwen2.5-Coder pair (CPU), and the natural AL at
# k=5 with the 0.5B draft model and with n-gram drafting. Writes a result file with provenance.
# Usage: experiments/qwen_pair_spec_check.sh [MODELS_DIR] [OUT_FILE]
set -euo pipefail
cd "$(dirname "$0")/.."
M=${1:-$HOME/.cache/specula/models}
OUT=${2:-experiments/results/qwen25_coder_spec_greedy_equivalence.md}
T=$M/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
D=$M/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
BIN=./target/release/specula
cargo build --release --locked -q
tmp=$(mktemp -d)
{
  echo "# Greedy speculative == plain on Qwen2.5-Coder 1.5B (target) / 0.5B (draft), CPU"
  echo
  echo "$(date -u +%FT%TZ), git $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- . ':!experiments/results' || echo ' (dirty)'), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs) x $(nproc) cores."
  echo "Target sha256 $(sha256sum "$T" | cut -c1-16)..., draft sha256 $(sha256sum "$D" | cut -c1-16)...; Q4_K_M GGUF dequantised to bf16."
  echo "Temperature 0, 96 new tokens, acceptance rule greedy, **natural acceptance**. AL = tokens emitted per verify step, bonus included."
  echo "No speed numbers here: this run shares the 2-core machine with other work (see cpu_bench_* for speed)."
  echo
  echo "| prompt | drafter | k | spec ids == plain ids | AL | verify steps | generated tokens |"
  echo "|---|---|---|---|---|---|---|"
} > "$OUT"
i=0
while IFS= read -r prompt; do
  i=$((i+1))
  args=(--model "$T" --prompt "$prompt" --max-tokens 96 --temperature 0 --json)
  [[ "$prompt" == "Write"* ]] && args+=(--chat)
  "$BIN" generate "${args[@]}" > "$tmp/plain$i.json" 2>/dev/null
  n_plain=$(python3 -c "import json;print(len(json.load(open('$tmp/plain$i.json'))['token_ids']))")
  echo "| \`$prompt\` | none (plain) | 0 | - | 1.00 | - | $n_plain |" >> "$OUT"
  for drafter in "$D" ngram; do
    "$BIN" generate "${args[@]}" --draft "$drafter" --num-draft-tokens 5 > "$tmp/spec$i.json" 2>/dev/null
    python3 - "$tmp/plain$i.json" "$tmp/spec$i.json" "$drafter" "$prompt" >> "$OUT" <<'PY'
import json, sys, os
p, s = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
st = s["stats"]
name = "0.5B draft model" if sys.argv[3] != "ngram" else "ngram"
print(f"| `{sys.argv[4]}` | {name} | 5 | {p['token_ids'] == s['token_ids']} | {st['acceptance_length']:.2f} | {st['num_verify_steps']} | {len(s['token_ids'])} |")
PY
  done
done <<'PROMPTS'
def fibonacci(n):
def quicksort(arr):
Write a Python function that checks whether a string is a palindrome.
PROMPTS
cat "$OUT"
