#!/usr/bin/env python3
"""Peer baseline for `specula bench step`: HF transformers, static KV cache, torch.compile (CUDA graphs).

The same shape (the preset's HF config.json from model/presets/, random bf16 weights, no hub access),
the same settings (running requests x tokens per step) and the same metric: median host inter-token
latency of the target step (input ids to the device, forward with the static cache, greedy ids of every
position back to the host, synchronise), prefill excluded. Verify steps (tokens > 1) commit a synthetic
accepted count drawn from the same minimum-variance rule (mean length 3.78 at k = 7 -> 2 or 3 drafts +
1); HF's static cache has one cache position for the whole batch, so all sequences of a batch commit
the same count (specula draws it per sequence: same mean KV growth). Rollback = moving the cache
position back (entries past it are masked and later overwritten).

Usage (on the GPU machine): python3 experiments/peers/hf_step.py --shape llama3.2-1b --out DIR
  [--batches 1,2,4,8] [--tokens 1,8] [--context 128] [--steps 64] [--runs 3] [--prompts 4]
  [--specula-json step_bench_llama3.2-1b.json]   (adds a side-by-side table)
"""

import argparse
import datetime
import json
import math
import os
import pathlib
import random
import statistics
import sys
import time

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

ROOT = pathlib.Path(__file__).resolve().parents[2]


def percentile(xs, p):
    xs = sorted(xs)
    return xs[round((len(xs) - 1) * p)]


def synthetic_accepted(length, k, rng):
    """Accepted drafts under the minimum-variance rule: floor(L-1) always, one more with prob frac."""
    n = min(length, k + 1) - 1
    full = math.floor(n)
    extra = 1 if (full < k and rng.random() < n - full) else 0
    return full + extra


def make_cache(model, config, batch, max_len):
    from transformers import StaticCache

    try:  # transformers >= 4.56: layers are sized lazily from the first update
        return StaticCache(config=config, max_cache_len=max_len)
    except TypeError:
        return StaticCache(
            config=config,
            max_batch_size=batch,
            max_cache_len=max_len,
            device=model.device,
            dtype=torch.bfloat16,
        )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama3.2-1b")
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--tokens", default="8,1")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--acceptance-length", type=float, default=3.78)
    ap.add_argument("--no-compile", action="store_true", help="eager (to check the script)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", required=True)
    ap.add_argument("--specula-json", default=None)
    ap.add_argument("--override", action="append", default=[],
                    help="KEY=INT config override (only to check the script on a small model)")
    args = ap.parse_args()

    cfg = json.loads((ROOT / "model" / "presets" / f"{args.shape}.json").read_text())
    model_type = cfg.pop("model_type")
    for key in ("architectures", "torch_dtype"):
        cfg.pop(key, None)
    for kv in args.override:
        key, value = kv.split("=", 1)
        cfg[key] = int(value)
    config = AutoConfig.for_model(model_type, **cfg)
    torch.manual_seed(0)
    t0 = time.time()
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.eval()
    build_s = time.time() - t0
    dev = torch.device(args.device)
    gpu = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(f"{args.shape}: {sum(p.numel() for p in model.parameters()) / 1e9:.3f} B params on {gpu}, "
          f"torch {torch.__version__}, transformers {transformers.__version__}", flush=True)
    torch._dynamo.config.cache_size_limit = 64

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def step(input_ids, cache):
        # Positions come from the cache's committed length (transformers 5 has no cache_position).
        out = model(input_ids=input_ids, past_key_values=cache, use_cache=True, return_dict=True)
        return out.logits.argmax(-1)

    def set_length(cache, length):
        for layer in cache.layers:
            if getattr(layer, "is_initialized", False):
                layer.cumulative_length.fill_(length)

    compiled = step if args.no_compile else torch.compile(step, mode="reduce-overhead")
    def write_report():
        report = {
            "peer": "HF transformers, StaticCache, torch.compile(mode='reduce-overhead')"
            + (" [eager: --no-compile]" if args.no_compile else ""),
            "metric": "median host inter-token latency of the target step (ids to device, forward, greedy ids back, sync), prefill excluded",
            "acceptance_mode": "synthetic",
            "gpu": gpu,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "git_revision": os.environ.get("SPECULA_GIT_REVISION", "unknown"),
            "shape": f"{args.shape} (random bf16 weights from the HF config, torch seed 0)",
            "model_build_s": build_s,
            "config": vars(args),
            "rows": rows,
        }
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"hf_step_{args.shape}.json").write_text(json.dumps(report, indent=2))
        return out

    batches = [int(x) for x in args.batches.split(",")]
    tokens = [int(x) for x in args.tokens.split(",")]
    rng = random.Random(1234)
    rows = []
    for t in tokens:
        for b in batches:
            max_len = args.context + args.steps * t + 2 * t + 16
            cache = make_cache(model, config, b, max_len)
            samples, run_medians, compile_s = [], [], None
            for run in range(args.runs + 1):  # run 0: one untimed group (compiles, records graphs)
                run_samples = []
                groups = 1 if run == 0 else args.prompts
                for _ in range(groups):
                    steps = 4 if run == 0 else args.steps
                    cache.reset()
                    prompt = torch.randint(0, config.vocab_size, (b, args.context), device=dev)
                    with torch.no_grad():
                        out = model(input_ids=prompt, past_key_values=cache, use_cache=True)
                    pending = out.logits[:, -1].argmax(-1).tolist()
                    pos = args.context
                    for s in range(steps):
                        block = [[p] + [rng.randrange(config.vocab_size) for _ in range(t - 1)] for p in pending]
                        ts = time.perf_counter()
                        ids_dev = torch.tensor(block, device=dev)
                        if not args.no_compile:
                            torch.compiler.cudagraph_mark_step_begin()
                        with torch.no_grad():
                            ids = compiled(ids_dev, cache).cpu()
                        sync()
                        ms = (time.perf_counter() - ts) * 1e3
                        if run == 0 and s == 0:
                            compile_s = ms / 1e3
                        if run > 0:
                            run_samples.append(ms)
                        a = synthetic_accepted(args.acceptance_length, t - 1, rng) if t > 1 else 0
                        pending = ids[:, a].tolist()
                        pos += 1 + a
                        if t > 1:  # roll back the rejected positions (not timed, as in specula)
                            set_length(cache, pos)
                            sync()
                if run > 0:
                    run_medians.append(statistics.median(run_samples))
                    samples += run_samples
            row = {
                "running_requests": b,
                "tokens_per_seq": t,
                "steps_timed": len(samples),
                "step_ms_median": statistics.median(samples),
                "step_ms_p90": percentile(samples, 0.9),
                "step_ms_run_medians": run_medians,
                "first_call_s": compile_s,
            }
            print(f"HF B={b} T={t}: median {row['step_ms_median']:.3f} ms, P90 {row['step_ms_p90']:.3f} ms, "
                  f"first call {compile_s:.1f} s", flush=True)
            rows.append(row)
            write_report()  # after every setting, so a cut-off run keeps what it measured
            del cache
    out = write_report()
    if args.specula_json:
        ours = json.loads(pathlib.Path(args.specula_json).read_text())
        by_key = {(r["running_requests"], r["tokens_per_seq"]): r for r in ours["rows"]}
        lines = [
            f"# Step time, specula vs HF transformers (static cache + torch.compile): {args.shape}, {gpu}",
            "",
            f"Same run on the device; {args.context} positions of random context; synthetic acceptance "
            f"{args.acceptance_length} at tokens 8; medians of {args.runs} runs x {args.prompts} prompt groups "
            f"x {args.steps} steps. specula git {ours.get('git_revision')}, torch {torch.__version__}, "
            f"transformers {transformers.__version__}. Floor = (weights + KV bytes) / measured copy bandwidth.",
            "",
            "| running requests | tokens/seq | specula ms (P90) | graph replay ms | HF ms (P90) | HF / specula | floor ms | specula % of floor |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in rows:
            o = by_key.get((r["running_requests"], r["tokens_per_seq"]))
            if o is None:
                continue
            replay = o.get("graph_replay_ms_median")
            lines.append(
                f"| {r['running_requests']} | {r['tokens_per_seq']} | {o['step_ms_median']:.3f} ({o['step_ms_p90']:.3f}) | "
                f"{'-' if replay is None else f'{replay:.3f}'} | {r['step_ms_median']:.3f} ({r['step_ms_p90']:.3f}) | "
                f"{r['step_ms_median'] / o['step_ms_median']:.2f}x | {o['floor_ms']:.3f} | {o['percent_of_floor']:.0f}% |"
            )
        (out / f"compare_{args.shape}.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
