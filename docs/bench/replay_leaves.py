#!/usr/bin/env python3
"""Where a policy loses prefix hits: requests that stay with, or leave, the
worker that last served their prefix, by how long ago it did.

usage: replay_leaves.py TRACE CSV...
  TRACE: the replayed trace (JSON lines, `.gz` read gunzipped);
  CSV: files of `kvpick-anchors replay ... --dump-requests DIR`
  (`POLICY-BLOCKS-SPEED.csv`, one row per request in trace order).
For every request whose leading blocks an earlier request (by arrival) also
had, the *holder* is the worker that served the longest such prefix last.
Per policy and age of that last use, prints the requests that went to the
holder (stay) and elsewhere (leave), each with blocks hit / blocks shared.
A leave of a recent prefix usually gives up hits the holder still had; an
old one mostly finds the prefix evicted everywhere.
Then, from the pools themselves at each arrival: the blocks the best worker's
pool held, those the chosen worker's held, the picks below the best and the
blocks they gave up, and how the chosen worker's hits moved from arrival to the
start of the prefill (a prefill of the same prefix ahead of it adds hits;
evictions while it waits take them).
"""
import csv
import gzip
import json
import sys
from pathlib import Path

AGES_S = [(0, 10), (10, 30), (30, 60), (60, 120), (120, None)]


def trace_ids(path):
    """Every request's hash ids, in trace order."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return [json.loads(line)["hash_ids"] for line in f if line.strip()]


def shared_prefixes(ids, rows):
    """Per request that shares a prefix: (shared blocks, hit blocks, stayed, age s)."""
    last = {}  # prefix (tuple of ids) -> (worker, arrival ms) of its last request
    order = sorted(range(len(rows)), key=lambda i: float(rows[i]["arrival_ms"]))
    out = []
    for i in order:
        row, h = rows[i], ids[i]
        worker, at = int(row["worker"]), float(row["arrival_ms"])
        shared, holder = 0, None
        for k in range(1, len(h) + 1):
            seen = last.get(tuple(h[:k]))
            if seen is None:
                break
            shared, holder = k, seen
        shared = min(shared, int(row["blocks"]))
        if shared:
            hit = min(int(row["hit_blocks"]), shared)
            out.append((shared, hit, holder[0] == worker, (at - holder[1]) / 1000))
        for k in range(1, len(h) + 1):
            last[tuple(h[:k])] = (worker, at)
    return out


def main():
    ids = trace_ids(sys.argv[1])
    for path in sys.argv[2:]:
        with open(path) as f:
            rows = list(csv.DictReader(f))
        found = shared_prefixes(ids, rows)
        print(f"\n{Path(path).stem}: age of the holder's last use | stays: n, hit/shared | leaves: n, hit/shared\n")
        print("| age s | stays | stay hits | leaves | leave hits |")
        print("| --- | --- | --- | --- | --- |")
        for lo, hi in AGES_S:
            band = [x for x in found if x[3] >= lo and (hi is None or x[3] < hi)]
            stay = [x for x in band if x[2]]
            leave = [x for x in band if not x[2]]
            label = f"{lo}–{hi}" if hi is not None else f"≥ {lo}"
            print(f"| {label} | {len(stay)} | {sum(x[1] for x in stay):,} / {sum(x[0] for x in stay):,} "
                  f"| {len(leave)} | {sum(x[1] for x in leave):,} / {sum(x[0] for x in leave):,} |")
        placement(rows)


def placement(rows):
    """The pools at arrival against the pick (dumps with `best_arrival_hit_blocks`)."""
    if not rows or "best_arrival_hit_blocks" not in rows[0]:
        return
    best = [int(r["best_arrival_hit_blocks"]) for r in rows]
    chosen = [int(r["arrival_hit_blocks"]) for r in rows]
    hits = sum(int(r["hit_blocks"]) for r in rows)
    below = [(b, c) for b, c in zip(best, chosen) if b > c]
    print(f"\nat arrival: best pool {sum(best):,} blocks, chosen pool {sum(chosen):,}; "
          f"{len(below)} picks below the best gave up {sum(b - c for b, c in below):,}; "
          f"hits at prefill start {hits:,} ({hits - sum(chosen):+,} from arrival)")


if __name__ == "__main__":
    main()
