#!/usr/bin/env bash
# The engine on the GPU, in one device call: `specula serve --device cuda` with the DL7 configuration (DSpark, k=7;
# natural, then synthetic AL 3.78) answering completions and exposing metrics, `specula generate --device cuda`
# smokes, gpu_e2e_check and gpu_dspark_check. Binaries built here and carried in .carry/bin; the DeepSpec fixture
# carried in .carry/fixtures/dspark-deepspec (../shared does not travel). Everything lands in ONE tarball in $OUT
# (the device tool returns at most 8 files).
#   run(command="bash experiments/run_gpu_engine_h200.sh", carry=[".carry/bin", ".carry/fixtures"])
set -uo pipefail
out=/tmp/gpu_engine; rm -rf "$out"; mkdir -p "$out"
libs=$(python3 -c "import nvidia, glob, os; print(':'.join(sorted({os.path.dirname(p) for b in nvidia.__path__ for p in glob.glob(os.path.join(b, '**', 'lib*.so*'), recursive=True)})))")
export LD_LIBRARY_PATH="$libs:/usr/local/cuda/lib64"; export SPECULA_DEFAULT_MODELS=$PWD/models/default RUST_BACKTRACE=0
B=${SPECULA_BIN:-.carry/bin}; S='{"method": "dspark", "num_speculative_tokens": 7'
save() { tar -czf "$OUT/gpu_engine.tgz" -C "$out" .; }
serve_once() {  # $1 label, $2 speculative config
    local port=8931
    $B/specula serve --device cuda --port $port --speculative-config "$2" > "$out/serve_$1.log" 2>&1 &
    local pid=$!
    for _ in $(seq 1 120); do curl -sf localhost:$port/health > /dev/null && break; sleep 0.5; done
    for p in "def read_config(path):" "ROMEO:" "The capital of France is"; do
        curl -s localhost:$port/v1/completions -d "{\"model\": \"specula-default\", \"prompt\": \"$p\", \"max_tokens\": 64}"; echo
    done > "$out/serve_$1_completions.jsonl"
    curl -s localhost:$port/v1/completions -d '{"model": "specula-default", "prompt": "ROMEO:", "max_tokens": 48, "stream": true}' > "$out/serve_$1_stream.txt"
    curl -s localhost:$port/metrics > "$out/serve_$1_metrics.txt"
    kill $pid; wait $pid 2>/dev/null
    echo "serve $1: $(grep -c '"choices"' "$out/serve_$1_completions.jsonl")/3 completions; $(grep -E '^specula_(acceptance_length|draft|verify|decode_backend)' "$out/serve_$1_metrics.txt" | head -8 | tr '\n' ';')"
}
{
    nvidia-smi -L; date -u
    serve_once natural "$S}"
    serve_once synthetic "$S, \"synthetic_acceptance_length\": 3.78}"
    save
    R='import json,sys; d=json.load(sys.stdin); r=d["run"]; print({k: r.get(k) for k in ("device","verifier","drafter","rule","acceptance_mode","acceptance_length","num_verify_steps","draft_ms","verify_ms","decode_backend","decode_backend_fallbacks","decode_backend_specialized_steps")})'
    for spec in "$S}" "$S, \"synthetic_acceptance_length\": 3.78}"; do
        echo "== generate --device cuda $spec"
        $B/specula generate --device cuda --speculative-config "$spec" --prompt "def read_config(path):" --max-tokens 64 --json | python3 -c "$R"
    done
    echo "== generate --device cuda, decode_backend latency_specialized (fused kernel), $S, synthetic 3.78}"
    $B/specula generate --device cuda --speculative-config "$S, \"synthetic_acceptance_length\": 3.78}" --additional-config '{"decode_backend": "latency_specialized"}' --prompt "def read_config(path):" --max-tokens 64 --json | python3 -c "$R"
    echo "== gpu_e2e_check"; timeout 200 $B/gpu_e2e_check --root "$PWD" > "$out/gpu_e2e_check.txt" 2>&1; echo "rc=$?"; tail -22 "$out/gpu_e2e_check.txt"
    save
    echo "== gpu_dspark_check"; timeout 120 $B/gpu_dspark_check --fixture .carry/fixtures/dspark-deepspec --reps 20 > "$out/gpu_dspark_check.txt" 2>&1; echo "rc=$?"; tail -12 "$out/gpu_dspark_check.txt"
    date -u
} 2>&1 | tee "$out/log.txt"
save
