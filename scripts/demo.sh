#!/usr/bin/env bash
# The main job on a fresh clone: fetch the real Qwen2.5-Coder pair (once, cached outside the repo), build,
# and generate with it. Until the embedded default model pair exists (issue 4), this runs plain greedy
# generation of the 1.5B target on the CPU reference backend.
set -euo pipefail
cd "$(dirname "$0")/.."
MODELS=${SPECULA_MODELS:-$HOME/.cache/specula/models}
bash ../shared/models/fetch_qwen_coder_pair.sh "$MODELS"
cargo build --release --locked
./target/release/specula generate \
  --model "$MODELS/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf" \
  --prompt "def fibonacci(n):" --max-tokens 64 --temperature 0 "$@"
