"""Long-run decoder fuzzing: ``python tests/fuzz/run.py --inputs 100000 --out fuzz.json``.

Runs every family of :mod:`fuzzlib` (or those named with ``--families``) in its own process, two at a time by
default, so each family's peak-memory figure is its own. Prints a table (family, inputs, ProtocolError count,
accepted, other exceptions, slow calls, calls over the memory bound, slowest call, peak RSS growth), writes it
with the first findings of each family as JSON, and exits 1 if any family had another exception, a slow call or
a memory finding.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fuzzlib


def _one(args: tuple[str, int, int]) -> dict:
    name, inputs, seed = args
    t0 = time.perf_counter()
    report = fuzzlib.run_family(name, inputs, seed)
    return {**dataclasses.asdict(report), "wall_s": round(time.perf_counter() - t0, 1), "ok": report.ok}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=int, default=100_000, help="inputs per family")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=2, help="families fuzzed at once, one process each")
    parser.add_argument("--families", nargs="*", default=list(fuzzlib.FAMILY_BUILDERS))
    parser.add_argument("--out", type=Path, default=None, help="JSON report")
    args = parser.parse_args(argv)
    unknown = set(args.families) - set(fuzzlib.FAMILY_BUILDERS)
    if unknown:
        parser.error(f"unknown families {sorted(unknown)}; known: {', '.join(fuzzlib.FAMILY_BUILDERS)}")
    ctx = multiprocessing.get_context("spawn")
    rows = []
    with ctx.Pool(args.jobs, maxtasksperchild=1) as pool:
        for row in pool.imap_unordered(_one, [(f, args.inputs, args.seed) for f in args.families]):
            rows.append(row)
            print(f"done {row['family']}: {row['inputs']} inputs in {row['wall_s']} s", file=sys.stderr, flush=True)
    rows.sort(key=lambda r: args.families.index(r["family"]))
    head = (f"{'family':<22}{'inputs':>9}{'Protocol':>10}{'accepted':>10}{'bad_acc':>8}{'other':>7}{'slow':>6}{'mem':>5}"
            f"{'slowest_ms':>12}{'peak_MiB':>10}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['family']:<22}{r['inputs']:>9}{r['rejected']:>10}{r['accepted']:>10}{r['bad_accept']:>8}{r['other']:>7}{r['slow']:>6}"
              f"{r['memory']:>5}{r['slowest_s'] * 1000:>12.1f}{r['peak_rss_growth'] / 2**20:>10.1f}")
    print("(Protocol: ProtocolError, or UserInputError for the checkpoint loader; bad_acc: accepted although the "
          "family's oracle finds it malformed; other: any other exception or a hang; slow: calls over 1 s; mem: calls "
          "raising peak RSS by over 64 MiB; peak: growth of peak RSS over the family's warmed-up baseline)")
    for r in rows:
        for f in r["findings"][:3]:
            print(f"\n[{r['family']}] {f}")
    if args.out:
        args.out.write_text(json.dumps({"inputs_per_family": args.inputs, "seed": args.seed, "families": rows},
                                       indent=1))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
