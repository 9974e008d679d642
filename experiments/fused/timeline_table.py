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
       timeline_table.py BENCH_A BENCH_B ...   (stage times and step medians side by side, e.g. the ablation
       kernels of make_candidates.sh)
       timeline_table.py --per-cta BENCH_OUTPUT   (a bench run with --v2-profile-cta: each CTA's gate/up and
       down stage times at the marked layer, by the CTA's tile count, and the slowest CTAs with their SMs;
       then the attention item's steps, per item)
"""
import argparse
import os
import re
import sys

# (printed slot name prefix, event, which count the mean is diluted by: None = every CTA)
EVENTS = [
    ("MMA loops", "layer start (the CTA's down tiles of the layer before done)", None),
    ("Q QKV", "Q: counter of the layer before seen", None),
    ("A: head vectors", "Q: QKV tiles done", None),
    ("A attention", "A: item sees the Q counter", "items"),
    # Slots 17 and 19-21: the attention item's inner events (timeline.patch since session 25).
    ("wait before D", "A: item's head vectors staged", "items"),
    ("wait before the LM head", "A: item's first key tile in shared memory", "items"),
    ("wait before Q", "A: item's keys and softmax done", "items"),
    ("ring chunk waits", "A: item's partials fenced (thread 0)", "items"),
    ("norm stages' staging", "A: item's partials and split counter done", "items"),
    ("tile epilogues", "A: combining item's fence done", "combiners"),
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


def parse(path, grid, counts):
    """The bench's profile table as {event: (a_mean, a_max, b_mean, b_max)}, its two shapes, and the v2
    step medians (ms) by shape from the bench table."""
    rows, header, steps = {}, None, {}
    for line in open(path):
        if line.startswith("| category |"):
            header = [c.strip() for c in line.strip().strip("|").split("|")]
            continue
        m = re.match(r"^\| (.+?) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$", line.strip())
        if header and m:
            rows[m[1]] = [float(m[i]) for i in range(2, 6)]
        # | b | t | standard (p90) | fused v1 (p90) | fused v2 (p90) | ...
        m = re.match(r"^\| (\d+) \| (\d+) \| [\d.]+ \([\d.]+\) \| [\d.]+ \([\d.]+\) \| ([\d.]+) \(", line)
        if m:
            steps[f"{m[1]} x {m[2]}"] = float(m[3])
    if not rows:
        sys.exit(f"{path}: no profile table")
    shapes = [header[1].replace(" mean", ""), header[3].replace(" mean", "")] if header else ["a", "b"]
    table = {}
    for prefix, event, dilution in EVENTS:
        name = next((n for n in rows if n.startswith(prefix)), None)
        if name is None:
            continue
        a_mean, a_max, b_mean, b_max = rows[name]
        if dilution:
            scale = grid / counts[dilution]
            a_mean, b_mean = a_mean * scale, b_mean * scale
        table[event] = (a_mean, a_max, b_mean, b_max)
    return table, shapes, steps


def stage_times(table):
    """Critical-path stage durations (max to max) for both shapes: [(stage, a_us, b_us)]."""
    out = []
    for stage, start, end in STAGES:
        if start in table and end in table:
            out.append((stage, table[end][1] - table[start][1], table[end][3] - table[start][3]))
    return out


def compare(paths, grid, counts):
    """One column per bench file (e.g. the ablation kernels): the stages of the marked layer and the step."""
    parsed = [parse(p, grid, counts) for p in paths]
    names = [os.path.basename(p).removeprefix("bench_").removesuffix(".txt") for p in paths]
    shapes = parsed[0][1]
    for k, shape in enumerate(shapes):
        print(f"\n{shape}, us (stages max to max; layer = their sum; LM head from its counter to done):")
        print("| stage | " + " | ".join(names) + " |")
        print("|---|" + "---:|" * len(names))
        per_file = [dict((st, (a, b)[k]) for st, a, b in stage_times(t)) for t, _, _ in parsed]
        for stage, _, _ in STAGES:
            print(f"| {stage} | " + " | ".join(f"{d[stage]:.1f}" if stage in d else "-" for d in per_file) + " |")
        print("| layer | " + " | ".join(f"{sum(d.values()):.1f}" for d in per_file) + " |")
        head = []
        for t, _, _ in parsed:
            a = t.get("LM head: last layer's counter seen")
            b = t.get("LM head done")
            head.append(f"{b[1 + 2 * k] - a[1 + 2 * k]:.1f}" if a and b else "-")
        print("| LM head | " + " | ".join(head) + " |")
        step = [steps.get(shape.replace("x", " x ").replace("  ", " ").strip()) for _, _, steps in parsed]
        print("| step, ms (v2 median) | " + " | ".join(f"{v:.3f}" if v else "-" for v in step) + " |")


# Per-CTA slots of the timeline kernel (timeline.patch): event times in cycles since the CTA's start, and
# values stored at the marked layer.
SLOT_G_SEEN, SLOT_G_DONE, SLOT_D_SEEN, SLOT_D_DONE = 7, 8, 9, 10
SLOT_SM, SLOT_G_TILES, SLOT_D_TILES = 24, 25, 26
SLOT_Q_SEEN = 1
# fv2_gemm's staging marks (timeline.patch since session 24): activations staged, then the first chunk's
# weights ready, for gate/up and down.
SLOT_G_STAGED, SLOT_G_FIRST, SLOT_D_STAGED, SLOT_D_FIRST = 27, 28, 29, 30
# timeline_stage.patch's marks inside gate/up's one-pass norm staging (thread 0): activations loaded and
# warp-summed, the row-sum barrier passed, pieces normalised and stored. Since session 32 the two-pass
# staging (more pieces than the one pass takes) sets the same slots at its matching points: row sums
# loaded and warp-summed, the inv_rms barrier passed, pieces normalised and stored. Slot 22 is set by no other
# timeline kernel, so its presence says which kernel wrote slots 15 and 18 (timeline_keys.patch uses them
# inside the attention item's keys tile).
SLOT_G_LOADED, SLOT_G_ROWSUM, SLOT_G_PACKED = 15, 18, 22
# timeline_stage2.patch (session 31, now under ../results/fused_h100_s31/patches/; on that session's
# timeline_stage.patch): slot 18 on entering the one-pass staging (instead of after
# the row-sum barrier), then the loads and warp sums twice, slot 31 after the first pass (slot 15 after the
# second).
SLOT_G_ENTRY, SLOT_G_PASS1 = 18, 31


def has_stage_marks(ctas):
    return any(c[SLOT_G_PACKED] > 0 for c in ctas)


def parse_per_cta(path):
    """The per-CTA tables of a --v2-profile-cta bench: [(shape, clock_khz, [[slot values] per CTA])]."""
    out, cur = [], None
    for line in open(path):
        m = re.match(r"^fused step profile per CTA, v2 \(dataflow\), (\d+ x \d+): .* at ([\d.]+) kHz", line)
        if m:
            cur = (m[1], float(m[2]), [])
            out.append(cur)
            continue
        if cur and re.match(r"^\| \d+ \|", line):
            cur[2].append([int(v) for v in line.strip().strip("|").split("|")[1:]])
    if not out:
        sys.exit(f"{path}: no per-CTA profile (run the bench with --v2-profile-cta)")
    return out


def per_cta_report(path):
    for shape, khz, ctas in parse_per_cta(path):
        us = lambda c: c / khz * 1e3  # noqa: E731
        print(f"\n{shape}: gate/up and down at the marked layer, per CTA (us from the CTA's counter seen to its last tile)")
        for stage, seen, done, tiles_slot, staged, first in (
                ("gate/up", SLOT_G_SEEN, SLOT_G_DONE, SLOT_G_TILES, SLOT_G_STAGED, SLOT_G_FIRST),
                ("down", SLOT_D_SEEN, SLOT_D_DONE, SLOT_D_TILES, SLOT_D_STAGED, SLOT_D_FIRST)):
            rows = [(i, c[SLOT_SM], c[tiles_slot], us(c[done] - c[seen])) for i, c in enumerate(ctas) if c[tiles_slot] > 0]
            if not rows:
                continue
            # When each CTA saw the counter, against the median CTA. The slots count cycles since each CTA's
            # start, and CTAs start up to a few us apart, so each CTA's times are taken from the moment it
            # saw the layer's first counter (slot 1, Q: every CTA polls it and sees it within ~1 us).
            ref = lambda c: c[seen] - (c[SLOT_Q_SEEN] if c[SLOT_Q_SEEN] > 0 else 0)  # noqa: E731
            seen_us = sorted(us(ref(ctas[i])) for i, *_ in rows)
            med = seen_us[len(seen_us) // 2]
            late = {i: us(ref(ctas[i])) - med for i, *_ in rows}
            print(f"\n{stage}: counter seen {seen_us[0] - med:+.1f} to {seen_us[-1] - med:+.1f} us around the median CTA"
                  " (times from each CTA's Q counter)")
            print(f"\n| {stage}: tiles per CTA | CTAs | mean us | min | max |")
            print("|---:|---:|---:|---:|---:|")
            for n in sorted({r[2] for r in rows}):
                d = [r[3] for r in rows if r[2] == n]
                print(f"| {n} | {len(d)} | {sum(d) / len(d):.1f} | {min(d):.1f} | {max(d):.1f} |")
            # Where the stage's start goes (kernels with the staging marks): the activations staged, then the
            # first chunk's weights in the ring, each from the CTA's sight of the counter.
            marked = [(r[2], us(ctas[r[0]][staged] - ctas[r[0]][seen]), us(ctas[r[0]][first] - ctas[r[0]][seen]))
                      for r in rows if ctas[r[0]][staged] > 0 and ctas[r[0]][first] > 0]
            if marked:
                print(f"\n| {stage}: tiles per CTA | staged: mean us | min | max | first chunk ready: mean us | min | max |")
                print("|---:|---:|---:|---:|---:|---:|---:|")
                for n in sorted({m[0] for m in marked}):
                    a = [m[1] for m in marked if m[0] == n]
                    b = [m[2] for m in marked if m[0] == n]
                    print(f"| {n} | {sum(a) / len(a):.1f} | {min(a):.1f} | {max(a):.1f} | {sum(b) / len(b):.1f} | {min(b):.1f} | {max(b):.1f} |")
            if stage == "gate/up" and has_stage_marks(ctas):
                # Slot 31 is set in the gate/up stage only by timeline_stage2.patch (timeline_keys.patch,
                # its other user, has no stage marks).
                two_pass = any(c[SLOT_G_PASS1] > 0 for c in ctas)
                if two_pass:
                    steps = [("counter seen -> staging entered (fv2_gemm's call and set-up)", seen, SLOT_G_ENTRY),
                             ("activations loaded, warp sums (first pass)", SLOT_G_ENTRY, SLOT_G_PASS1),
                             ("barrier, then the same again (second pass: L2 data, warm code)", SLOT_G_PASS1,
                              SLOT_G_LOADED),
                             ("row-sum barrier, norm weights, normalise, store", SLOT_G_LOADED, SLOT_G_PACKED)]
                else:
                    steps = [("activations loaded, warp sums", seen, SLOT_G_LOADED),
                             ("row-sum barrier", SLOT_G_LOADED, SLOT_G_ROWSUM),
                             ("norm weights, normalise, store", SLOT_G_ROWSUM, SLOT_G_PACKED)]
                steps.append(("barrier before the tiles", SLOT_G_PACKED, staged))
                print("\ngate/up staging, thread 0's steps (timeline_stage.patch; us)")
                print("\n| step | CTAs | median | mean | max |")
                print("|---|---:|---:|---:|---:|")
                for label, a, b in steps:
                    d = sorted(us(ctas[r[0]][b] - ctas[r[0]][a]) for r in rows
                               if ctas[r[0]][a] > 0 and ctas[r[0]][b] > 0)
                    if d:
                        print(f"| {label} | {len(d)} | {d[len(d) // 2]:.1f} | {sum(d) / len(d):.1f} | {d[-1]:.1f} |")
            rows.sort(key=lambda r: -r[3])
            fmt = lambda r: f"CTA {r[0]} (SM {r[1]}, {r[2]} tiles, seen {late[r[0]]:+.1f}) {r[3]:.1f}"  # noqa: E731
            print(f"\n{stage}, the 10 slowest CTAs: " + ", ".join(fmt(r) for r in rows[:10]))
            print(f"{stage}, the 10 fastest CTAs: " + ", ".join(fmt(r) for r in rows[-10:]))
            by_sm = sorted(rows, key=lambda r: r[1])
            print(f"{stage}, us by SM (SM:us): " + " ".join(f"{r[1]}:{r[3]:.0f}" for r in by_sm))
        attention_report(shape, us, ctas)


# The attention item's events (timeline.patch since session 25), as (label, from slot, to slot, combining
# items only). Each interval is within one CTA, so the CTAs' start offsets cancel.
SLOT_Q_DONE, SLOT_A_SEEN = 2, 3
ATTENTION_STEPS = [
    ("own QKV tiles done -> Q counter seen", SLOT_Q_DONE, SLOT_A_SEEN, False),
    ("head vectors (q, new k/v) staged", SLOT_A_SEEN, 17, False),
    ("first key tile in shared memory", 17, 19, False),
    ("keys and online softmax (the rest)", 19, 11, False),
    # timeline_keys.patch's marks inside the keys tile (thread 0's vector, its last tile): slots 15, 18, 31.
    ("  of which scores (q . k) and their max", 19, 15, False),
    ("  of which exponentials and their sum", 15, 18, False),
    ("  of which values (p . v)", 18, 31, False),
    ("  of which the stores and the barrier after the tile", 31, 11, False),
    ("partials written and fenced (thread 0)", 11, 20, False),
    ("split counter's add and barriers", 20, 12, False),
    ("combining item: fence", 12, 21, True),
    ("combining item: combine to act16", 21, 13, True),
]


def attention_report(shape, us, ctas):
    """Per-item durations of the attention item's steps at the marked layer, over the CTAs that ran one."""
    items = [c for c in ctas if c[SLOT_A_SEEN] > 0 and c[17] > 0 and c[19] > 0]
    if not items:
        return  # a timeline kernel without the attention marks
    print(f"\n{shape}: the attention item's steps at the marked layer ({len(items)} CTAs with an item; us)")
    print("\n| step | items | median | mean | max |")
    print("|---|---:|---:|---:|---:|")
    stage_marks = has_stage_marks(ctas)
    for label, a, b, combining in ATTENTION_STEPS:
        if stage_marks and (a in (15, 18) or b in (15, 18)):
            continue  # slots 15 and 18 are the staging marks in this kernel
        d = sorted(us(c[b] - c[a]) for c in items if c[a] > 0 and c[b] > 0 and (not combining or c[13] > 0))
        if d:
            print(f"| {label} | {len(d)} | {d[len(d) // 2]:.1f} | {sum(d) / len(d):.1f} | {d[-1]:.1f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench", nargs="+", help="one bench output, or several to compare side by side")
    ap.add_argument("--per-cta", action="store_true", help="each CTA's gate/up and down times (--v2-profile-cta)")
    ap.add_argument("--grid", type=int, default=132)
    ap.add_argument("--items", type=int, default=72)
    ap.add_argument("--tiles-o", type=int, default=128)
    ap.add_argument("--combiners", type=int, default=8)
    args = ap.parse_args()
    counts = {"items": args.items, "tiles_o": args.tiles_o, "combiners": args.combiners}
    if args.per_cta:
        for path in args.bench:
            per_cta_report(path)
        return
    if len(args.bench) > 1:
        compare(args.bench, args.grid, counts)
        return
    table, shapes, _ = parse(args.bench[0], args.grid, counts)
    print(f"| event | {shapes[0]} mean | max | {shapes[1]} mean | max |")
    print("|---|---:|---:|---:|---:|")
    for _, event, _ in EVENTS:
        if event in table:
            a_mean, a_max, b_mean, b_max = table[event]
            print(f"| {event} | {a_mean:.1f} | {a_max:.1f} | {b_mean:.1f} | {b_max:.1f} |")
    print(f"\n| stage (max to max) | {shapes[0]} us | {shapes[1]} us |")
    print("|---|---:|---:|")
    total = [0.0, 0.0]
    for stage, a, b in stage_times(table):
        total[0] += a
        total[1] += b
        print(f"| {stage} | {a:.1f} | {b:.1f} |")
    print(f"| layer | {total[0]:.1f} | {total[1]:.1f} |")


if __name__ == "__main__":
    main()
