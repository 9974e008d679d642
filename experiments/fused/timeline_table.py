#!/usr/bin/env python3
"""Reads the profile table of a timeline-kernel bench (timeline.patch, run with `gpu_fused_check --bench
--short --v2-profile`) and prints it as events of the marked layer, with stage durations.

The timeline kernel stores, per CTA, the cycles since the CTA's start at which thread 0 passed each event;
the bench prints the mean and max over all CTAs under the regular slot names. CTAs that never pass an
event (no attention item, no O or down tile, not the last split of a KV head) leave 0 there. The mean over
the CTAs that do pass it is the printed mean x grid / passing. The passing counts default to the
llama3.2-1b shape at 256 cached positions: 72 attention items (8 KV heads x 9 key splits), 128 O and down
tiles, 8 combining CTAs. Grid 132 (H200).

Usage: timeline_table.py BENCH_OUTPUT [--grid 132] [--items 72] [--tiles-o 128] [--combiners 8]
"""
import argparse
import re
import sys

# (printed slot name prefix, event, which count the mean is diluted by: None = every CTA)
EVENTS = [
    ("MMA loops", "layer start (the CTA's down tiles of the layer before done)", None),
    ("Q QKV", "Q: counter of the layer before seen", None),
    ("A: head vectors", "Q: QKV tiles done", None),
    ("A attention", "A: item sees the Q counter", "items"),
    ("wait before Q", "A: item's keys and softmax done", "items"),
    ("norm stages' staging", "A: item's partials and split counter done", "items"),
    ("wait before A's first item", "A: combine done", "combiners"),
    ("O O proj", "A: stage done (every CTA)", None),
    ("A: keys and online softmax", "O: counter of A seen", "tiles_o"),
    ("G gate/up", "O: tiles done", None),
    ("D down", "G: counter of O seen", None),
    ("A: partials and split counter", "G: gate/up tiles done", None),
    ("LM head", "D: counter of G seen", "tiles_o"),
    ("A: combine", "D: down tiles done", None),
    ("wait before O", "LM head: last layer's counter seen", None),
    ("wait before G", "LM head done", None),
]
# Critical-path stages: (name, from event, to event), each the max over CTAs.
STAGES = [
    ("Q", "Q: counter of the layer before seen", "Q: QKV tiles done"),
    ("A", "Q: QKV tiles done", "A: stage done (every CTA)"),
    ("O", "A: stage done (every CTA)", "O: tiles done"),
    ("G", "O: tiles done", "G: gate/up tiles done"),
    ("D", "G: gate/up tiles done", "D: down tiles done"),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench")
    ap.add_argument("--grid", type=int, default=132)
    ap.add_argument("--items", type=int, default=72)
    ap.add_argument("--tiles-o", type=int, default=128)
    ap.add_argument("--combiners", type=int, default=8)
    args = ap.parse_args()
    counts = {"items": args.items, "tiles_o": args.tiles_o, "combiners": args.combiners}
    rows = {}
    header = None
    for line in open(args.bench):
        if line.startswith("| category |"):
            header = [c.strip() for c in line.strip().strip("|").split("|")]
            continue
        m = re.match(r"^\| (.+?) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$", line.strip())
        if header and m:
            rows[m[1]] = [float(m[i]) for i in range(2, 6)]
    if not rows:
        sys.exit(f"{args.bench}: no profile table")
    shapes = [header[1].replace(" mean", ""), header[3].replace(" mean", "")] if header else ["a", "b"]
    table = {}
    print(f"| event | {shapes[0]} mean | max | {shapes[1]} mean | max |")
    print("|---|---:|---:|---:|---:|")
    for prefix, event, dilution in EVENTS:
        name = next((n for n in rows if n.startswith(prefix)), None)
        if name is None:
            continue
        a_mean, a_max, b_mean, b_max = rows[name]
        if dilution:
            scale = args.grid / counts[dilution]
            a_mean, b_mean = a_mean * scale, b_mean * scale
        table[event] = (a_mean, a_max, b_mean, b_max)
        print(f"| {event} | {a_mean:.1f} | {a_max:.1f} | {b_mean:.1f} | {b_max:.1f} |")
    print(f"\n| stage (max to max) | {shapes[0]} us | {shapes[1]} us |")
    print("|---|---:|---:|")
    total = [0.0, 0.0]
    for stage, start, end in STAGES:
        if start in table and end in table:
            a = table[end][1] - table[start][1]
            b = table[end][3] - table[start][3]
            total[0] += a
            total[1] += b
            print(f"| {stage} | {a:.1f} | {b:.1f} |")
    print(f"| layer | {total[0]:.1f} | {total[1]:.1f} |")


if __name__ == "__main__":
    main()
