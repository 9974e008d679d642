#!/usr/bin/env python3
"""Summarise an Nsight Compute source page (`ncu --page source --print-source sass --csv`, gzipped or not).

Prints the warp stall samples by reason, the instructions with the most samples (with their two main
reasons), and the samples at each barrier or mbarrier wait site (the instruction and the two after it, where
the stall lands). The kernel is compiled by NVRTC without line info, so sites are SASS instruction indices;
the CTA barriers `BAR.SYNC 0x1, 0x100` are the consumers' `fv2_sync`, `SYNCS.PHASECHK` the mbarrier waits.

Usage: ncu_sass_summary.py source_sass.csv.gz [--top N]
"""
import argparse
import csv
import gzip
import sys
from collections import Counter


def open_text(path):
    return gzip.open(path, "rt") if path.endswith(".gz") else open(path, newline="")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    rows = list(csv.reader(open_text(args.csv)))
    # Row 0 names the kernel; row 1 is the header.
    header = next((r for r in rows if r and r[0] == "Address"), None)
    if header is None:
        sys.exit(f"{args.csv}: no 'Address' header row; is this `--page source --csv` output?")
    start = rows.index(header) + 1
    data = [r for r in rows[start:] if len(r) == len(header)]
    col = {h: i for i, h in enumerate(header)}
    samples_col = col.get("Warp Stall Sampling (All Samples)")
    if samples_col is None:
        sys.exit(f"{args.csv}: no warp stall sampling column (profile with --set full or SourceCounters)")
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]

    def n(r, c):
        v = r[c].replace(",", "")
        return int(v) if v.isdigit() else 0

    total = sum(n(r, samples_col) for r in data)
    if total == 0:
        sys.exit("no samples")
    by_reason = Counter()
    for r in data:
        for h in reasons:
            by_reason[h] += n(r, col[h])
    print(f"{len(data)} instructions, {total} samples")
    print("by reason: " + ", ".join(f"{h[6:]} {v / total:.1%}" for h, v in by_reason.most_common(8)))
    print(f"\ntop {args.top} instructions:")
    top = sorted(range(len(data)), key=lambda i: -n(data[i], samples_col))[: args.top]
    for i in top:
        r = data[i]
        two = sorted(((n(r, col[h]), h[6:]) for h in reasons), reverse=True)[:2]
        why = ", ".join(f"{name} {v / total:.1%}" for v, name in two if v)
        print(f"  {i:6d} {n(r, samples_col) / total:6.2%}  {r[col['Source']].strip()[:60]:60s} {why}"
              f"  (executed {r[col['Instructions Executed']]})")
    print("\nwait sites (the instruction and the two after it), >= 0.3% of samples:")
    for i, r in enumerate(data):
        src = r[col["Source"]]
        if "BAR.SYNC" in src or "SYNCS.PHASECHK" in src or "NANOSLEEP" in src:
            s = sum(n(data[j], samples_col) for j in range(i, min(i + 3, len(data))))
            if s / total >= 0.003:
                print(f"  {i:6d} {s / total:6.2%}  {src.strip()[:60]:60s} (executed {r[col['Instructions Executed']]})")


if __name__ == "__main__":
    main()
