#!/usr/bin/env bash
# DSpark vs the embedded draft model on the GPU at equal settings (issue 8: "beats the draft model of
# similar cost"): natural acceptance, k = 7, T = 1 and T = 0, the first N prompts of
# experiments/prompts/heldback.jsonl, `specula generate --device cuda --json --ignore-eos`, one process per
# (prompt, temperature, drafter). Prints AL, drafting and verify time per verify step and decode tokens/s
# (end to end per request, drafting included). Needs the specula binary under .carry/bin, built here with
# `--features cuda` and packed as experiments/fused/run_fused_h200.sh describes; then:
#   run(command="mkdir -p .carry && tar -xJf .carry/pack/bin.tar.xz -C .carry && OUT=$OUT bash experiments/run_gpu_drafter_cost_h200.sh",
#       carry=[".carry/pack"], timeout_s=300)
# Tables: experiments/drafter_cost_table.py (pooled per drafter, then the prompts paired).
set -uo pipefail
n=${PROMPTS:-2}
max=${MAX_TOKENS:-256}
bin=${SPECULA_BIN:-.carry/bin}
out=${OUT:-/tmp/drafter_cost}
mkdir -p "$out"
libs=$(python3 -c "import nvidia, glob, os; print(':'.join(sorted({os.path.dirname(p) for b in nvidia.__path__ for p in glob.glob(os.path.join(b, '**', 'lib*.so*'), recursive=True)})))" 2>/dev/null)
export LD_LIBRARY_PATH="${libs}:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export SPECULA_DEFAULT_MODELS=${SPECULA_DEFAULT_MODELS:-$PWD/models/default}
{ date -u; cat "$bin/fused.rev" 2>/dev/null; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null; env | grep -E "^SPECULA_(DSPARK_CU|FUSED_STEP_CU)=" | sed "s/^/kernel source override: /"; } > "$out/header.txt"
for i in $(seq 1 "$n"); do
  prompt=$(sed -n "${i}p" experiments/prompts/heldback.jsonl | python3 -c 'import json, sys; print(json.loads(sys.stdin.read())["turns"][0], end="")')
  for t in 1 0; do
    # DSpark at k = 7 (the seed's DL7); the draft model at every k in DRAFT_KS (default 7: the same k;
    # "3 5 7" adds the draft model's cheaper settings, file names draft, draft3, draft5).
    for d in dspark $(for k in ${DRAFT_KS:-7}; do [ "$k" = 7 ] && echo draft || echo "draft$k"; done); do
      if [ "$d" = dspark ]; then spec=(--speculative-config '{"method": "dspark", "num_speculative_tokens": 7}')
      else k=${d#draft}; spec=(--draft "$SPECULA_DEFAULT_MODELS/draft" --num-draft-tokens "${k:-7}"); fi
      timeout 60 "$bin/specula" generate --device cuda --prompt "$prompt" --max-tokens "$max" --ignore-eos \
        --temperature "$t" --seed "$i" --json "${spec[@]}" > "$out/p${i}_t${t}_${d}.json" 2> "$out/p${i}_t${t}_${d}.err"
      echo "p$i T=$t $d rc=$?"
    done
  done
done
python3 experiments/drafter_cost_table.py "$out"
