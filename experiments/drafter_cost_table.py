#!/usr/bin/env python3
"""Tables of a drafter-cost run (experiments/run_gpu_drafter_cost_h200.sh): one `specula generate --json`
file per (prompt, temperature, drafter) named p{i}_t{T}_{dspark|draft}.json in DIR.

Files of the draft model at another k are named ..._draft{k}.json. Prints, per temperature, drafter and k,
pooled AL (1 + accepted / verify steps), drafting and verify ms per verify step and decode tokens/s (generated tokens / (total - prefill) wall time, drafting included: one request, so
this is per-user decode speed, not aggregate throughput); then, per temperature and other drafter setting,
the prompts paired: how many prompts DSpark decodes faster and the geometric mean / min / max of its
per-prompt speed ratio.
Usage: drafter_cost_table.py DIR
"""
import glob
import json
import math
import os
import sys


def main(out):
    stats = {}
    for f in sorted(glob.glob(os.path.join(out, "p*_t*_*.json"))):
        prompt, temp, drafter = os.path.basename(f)[: -len(".json")].split("_")
        try:
            stats[(prompt, temp, drafter)] = json.load(open(f))["stats"]
        except Exception as e:  # a failed run leaves an empty or partial file
            print(f"{os.path.basename(f)}: no stats ({e})")
    header = os.path.join(out, "header.txt")
    if os.path.exists(header):
        print(open(header).read().strip())
    print("| T | drafter | prompts | verify steps | AL (pooled) | draft ms / step | verify ms / step | decode tok/s (generated / decode wall) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    pooled = {}
    for (p, t, d), s in stats.items():
        r = pooled.setdefault((t, f'{s["drafter"]} k={s["num_draft_tokens"]}'), [0, 0, 0, 0.0, 0.0, 0, 0.0])
        r[0] += 1
        r[1] += s["num_verify_steps"]
        r[2] += s["accepted_tokens"]
        r[3] += s["draft_ms"]
        r[4] += s["verify_ms"]
        r[5] += s["generated_tokens"]
        r[6] += s["total_ms"] - s["prefill_ms"]
    for (t, d), r in sorted(pooled.items()):
        print(f"| {t[1:]} | {d} | {r[0]} | {r[1]} | {1 + r[2] / r[1]:.2f} | {r[3] / r[1]:.3f} | {r[4] / r[1]:.3f} | {r[5] / (r[6] / 1e3):.0f} |")
    print()
    print("| T | against | prompts paired | DSpark faster on | speed ratio DSpark / other: geomean | min | max |")
    print("|---|---|---:|---:|---:|---:|---:|")
    speed = lambda x: x["generated_tokens"] / (x["total_ms"] - x["prefill_ms"])
    others = sorted({k[2] for k in stats if k[2] != "dspark"})
    for t in sorted({k[1] for k in stats}):
        for other in others:
            ratios = [
                speed(s) / speed(stats[(p, t, other)])
                for (p, tt, d), s in stats.items()
                if tt == t and d == "dspark" and (p, t, other) in stats
            ]
            if ratios:
                g = math.exp(sum(map(math.log, ratios)) / len(ratios))
                sample = next(s for (_, tt, d), s in stats.items() if tt == t and d == other)
                label = f'{sample["drafter"]} k={sample["num_draft_tokens"]}'
                wins = sum(r > 1 for r in ratios)
                print(f"| {t[1:]} | {label} | {len(ratios)} | {wins} | {g:.3f} | {min(ratios):.3f} | {max(ratios):.3f} |")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
