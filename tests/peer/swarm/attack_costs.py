"""What a lying middle stage costs the model: the full replica's final validation loss against all-honest runs.

Usage: ``python tests/peer/swarm/attack_costs.py [--runs 3] [--rounds 10] [--lies forward:noise,...] [--out F.json]``

Each run is the audit process test's world (:mod:`test_audit_process`): real ``hlbp join`` processes on loopback, a
full replica and a 3-stage swarm (H = 4 steps of 2 micro-batches, seed 4) whose stage-1 peer lies as
:mod:`lying_stage_peer` says, or is honest; an honest standby of stage 1 joins once the swarm's first contribution is
sent, in every run. After ``--rounds`` rounds it reports, per run, the round the liar was caught in, the rounds the
swarm's work was accepted, which neighbours found their work tainted, and the full replica's final validation
loss; per lie, the mean against the honest runs' mean. A measuring tool beside the tests, like
``tests/peer/rounds/faulty_peer.py``: the liar is a test's wrapper, not part of the shipped client.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lying_stage_peer import program

from hlbp.peer.sim.launcher import SimConfig, Swarm, poll

LIES = ("forward:noise", "forward:scale", "backward:flip", "forward:noise:10")


def run(lie: str | None, rounds: int, full_replicas: int = 1, timeout_s: float = 900.0) -> dict[str, Any]:
    """One run of ``rounds`` rounds with stage 1 lying as ``lie`` says (None: honest), beside ``full_replicas``
    full replicas (the first one's validation loss is the run's)."""
    cfg = SimConfig(n_stages=3, inner_steps=4, batch_size=4, seq_len=64, seed=4, run_id="audit", ttl_s=8.0,
                    micro_batches=2)
    with tempfile.TemporaryDirectory() as tmp, Swarm(cfg, Path(tmp)) as sw:
        sw.start()
        sw.add_stage("s1", 1, program=program(lie) if lie else None).proc.wait_for("^announced", 60)
        sw.add_stage("s2", 2).proc.wait_for("^announced", 60)
        waited = str(3 + full_replicas)
        full = sw.add("peer0", "--wait-replicas", waited, rounds=1000)
        for i in range(1, full_replicas):
            sw.add(f"peer{i}", "--wait-replicas", waited, rounds=1000)
        driver = sw.add_stage("s0", 0, "--micro-batches", "2", "--eval-every", "0")
        poll(lambda: [r for r in driver.events("round") if r.get("contributed")] or None, timeout_s,
             "the swarm's first contribution")
        sw.add_stage("s1b", 1, swarm=0)
        poll(lambda: [r for r in full.events("round") if r["round"] >= rounds - 1 and r.get("val_loss") is not None]
             or None, timeout_s, f"{rounds} rounds of the full replica")
        losses = {r["round"]: r["val_loss"] for r in full.events("round")
                  if r.get("val_loss") is not None and r["round"] < rounds}
        caught = sorted({a["round"] for i in range(full_replicas) for a in sw.replicas[f"peer{i}"].events("audit")
                         if a["guilty"]})
        return {"lie": lie or "honest", "full_replicas": full_replicas, "final_loss": losses[max(losses)],
                "losses": losses,
                "caught_in": caught[0] if caught else None,
                "swarm_accepted": [r["round"] for r in driver.events("round") if r.get("accepted")],
                "tainted": {n: [r["round"] for r in sw.replicas[n].events("round") if r.get("tainted")]
                            for n in ("s0", "s2")}}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="runs of each (default 3)")
    ap.add_argument("--rounds", type=int, default=10, help="rounds of each run (default 10)")
    ap.add_argument("--lies", default=",".join(LIES), help="comma-separated WHERE:HOW[:EVERY] (lying_stage_peer)")
    ap.add_argument("--full", type=int, default=1, help="full replicas beside the swarm (default 1)")
    ap.add_argument("--out", type=Path, default=None, help="write every run as JSON here")
    args = ap.parse_args(argv)
    kinds = [None, *[x for x in args.lies.split(",") if x]]
    runs = [run(lie, args.rounds, args.full) for _ in range(args.runs) for lie in kinds]
    honest = statistics.mean(r["final_loss"] for r in runs if r["lie"] == "honest")
    print(f"{'stage 1':18s} {'caught in':>10s}  final losses{'':16s} vs honest mean")
    for lie in kinds:
        mine = [r for r in runs if r["lie"] == (lie or "honest")]
        mean = statistics.mean(r["final_loss"] for r in mine)
        caught = str([r["caught_in"] for r in mine])
        finals = ", ".join(f"{r['final_loss']:.3f}" for r in mine)
        print(f"{lie or 'honest':18s} {caught:>10s}  {finals:28s} {100 * (mean / honest - 1):+.2f} %")
    if args.out is not None:
        args.out.write_text(json.dumps({"runs": runs, "honest_mean": honest}, indent=1, default=str))


if __name__ == "__main__":
    main()
