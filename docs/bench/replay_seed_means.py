#!/usr/bin/env python3
"""Seed means of `kvpick-anchors replay` matrices, and a landing rule for a candidate.

usage: replay_seed_means.py BASE_DIR CAND_DIR [SEEDS]
  BASE_DIR, CAND_DIR: one directory per binary holding sS/matrix.md (S = seed),
  written by `kvpick-anchors replay ... --seed S --out DIR/sS/matrix.md`;
  SEEDS: a range, default 1-8.
Prints, per kvpick mode, the seed means (hit / TTFT p99 ms (ratio to BASE) /
spread) of both binaries and the peers, every point where CAND breaks the
landing rule (p99 above 1.02 × BASE's, hit more than 0.3 points below
BASE's), and both binaries' criterion counts on the
means (hit above both peers; TTFT p50 and p99 at or below round robin's and
both peers'), which the candidate must raise.
"""
import math
import statistics as st
import sys
from pathlib import Path

POINTS = [(b, s) for b in (1000, 4000) for s in ("0.5×", "1×", "2×")]
MODES = ("kvpick-precise", "kvpick-approx")
PEERS = ("llm-d", "dynamo")
P99_TOLERANCE = 1.02
HIT_TOLERANCE = 0.3


def load(directory, seeds):
    """(blocks, speed, policy) -> [hit %, spread, p50, p99] over the seeds."""
    rows = {}
    for seed in seeds:
        for line in (Path(directory) / f"s{seed}" / "matrix.md").read_text().splitlines():
            c = [x.strip() for x in line.strip().strip("|").split("|")]
            if len(c) != 9 or not c[0].isdigit() or not c[3].endswith("%") or c[5] == "–":
                continue
            figures = (float(c[3].rstrip("%")), float(c[5]), float(c[7]), float(c[8]))
            rows.setdefault((int(c[0]), c[1], c[2]), []).append(figures)
    return {k: [st.mean(x[i] for x in v) for i in range(4)] for k, v in rows.items()}


def criteria(table, b, s, mode):
    """(hit above both peers, TTFT p50 and p99 ≤ round robin's and the peers')."""
    k = table[(b, s, mode)]
    hit = all(k[0] > table[(b, s, p)][0] for p in PEERS)
    ttft = all(k[2] <= table[(b, s, p)][2] and k[3] <= table[(b, s, p)][3]
               for p in PEERS + ("round-robin",))
    return hit, ttft


def main():
    base_dir, cand_dir = sys.argv[1], sys.argv[2]
    lo, hi = map(int, (sys.argv[3] if len(sys.argv) > 3 else "1-8").split("-"))
    seeds = range(lo, hi + 1)
    base, cand = load(base_dir, seeds), load(cand_dir, seeds)
    met, ratios = True, []
    counts = {"base": [0, 0], "candidate": [0, 0]}
    for mode in MODES:
        print(f"\n{mode}, mean of seeds {lo}-{hi} (hit / TTFT p99 ms (ratio to base) / spread):\n")
        print("| binary | " + " | ".join(f"{b}@{s}" for b, s in POINTS) + " |")
        print("| --- " * (len(POINTS) + 1) + "|")
        for label, table, policy in (("base", base, mode), ("candidate", cand, mode),
                                     ("llm-d", base, "llm-d"), ("dynamo", base, "dynamo")):
            cells = []
            for b, s in POINTS:
                hit, spread, _, p99 = table[(b, s, policy)]
                ratio = f" ({p99 / base[(b, s, mode)][3]:.3f})" if policy == mode else ""
                cells.append(f"{hit:.2f}% / {p99:,.0f}{ratio} / {spread:.2f}")
            print(f"| {label} | " + " | ".join(cells) + " |")
        for b, s in POINTS:
            a, c = base[(b, s, mode)], cand[(b, s, mode)]
            ratios.append(c[3] / a[3])
            flags = {}
            for label, table in (("base", base), ("candidate", cand)):
                # The peers' rows are the same in both binaries: read them from BASE.
                merged = {**base, (b, s, mode): table[(b, s, mode)]}
                flags[label] = criteria(merged, b, s, mode)
                for i, ok in enumerate(flags[label]):
                    counts[label][i] += ok
            if flags["base"] != flags["candidate"]:
                print(f"criteria {mode} {b}@{s} (hit above peers, TTFT ≤ others): "
                      f"base {flags['base']}, candidate {flags['candidate']}")
            misses = []
            if c[3] > a[3] * P99_TOLERANCE:
                misses.append(f"p99 {c[3]:,.1f} > {P99_TOLERANCE} × {a[3]:,.1f} ({c[3] / a[3]:.4f})")
            if c[0] < a[0] - HIT_TOLERANCE - 1e-9:
                misses.append(f"hit {c[0]:.3f} < {a[0]:.3f} - {HIT_TOLERANCE}")
            if misses:
                met = False
                print(f"miss {mode} {b}@{s}: " + "; ".join(misses))
    geo = math.exp(st.mean(math.log(r) for r in ratios))
    print(f"\np99 ratios {min(ratios):.3f}-{max(ratios):.3f}, geometric mean {geo:.3f}")
    n = len(POINTS) * len(MODES)
    for label, (hit, ttft) in counts.items():
        print(f"{label}: hit above both peers {hit} of {n}, TTFT p50 and p99 ≤ round robin and peers {ttft} of {n}")
    if sum(counts["candidate"]) <= sum(counts["base"]):
        met = False
        print("criterion counts not raised")
    print("rule met" if met else "rule not met")


if __name__ == "__main__":
    main()
