"""Reading a test swarm's round records: by round, waited for with a deadline (the round-protocol tests' helpers)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hlbp.peer.node.replica import takeover_delay
from hlbp.peer.sim.launcher import SimConfig, Swarm, poll
from hlbp.protocol.identity import Identity
from hlbp.protocol.manifest import Hyperparameters

ROUND_TIMEOUT_S = 120.0  # a bound on waiting for a few rounds on 2 busy cores, not an expected duration
INNER_STEPS = 6
MAX_DEADLINE_S = 10.0  # the manifest's longest collection window
# the shortest: the peers share 2 cores here, so equal work finishes up to a second apart, and the window must
# absorb that jitter or honest peers become stragglers
MIN_DEADLINE_S = 2.0
# how long each further-ranked coordinator waits past the window in these runs: their manifest has two stages, so
# the delay covers a coordinator's audits of stage peers (18 s), whether or not any stage peer takes part
TAKEOVER_S = takeover_delay(SimConfig.n_stages)
# what an exchange still takes after its round closed (fetching, applying, verifying): 1.2 s of an 11.2 s wait
# past a 10 s window was seen in a loaded run of the whole suite
CLOSE_SLACK_S = 3.0
# the run's overlap mode: CI runs the default (eager, Hyperparameters.DEFAULT_OVERLAP); HLBP_TEST_OVERLAP=none runs
# every fault with each round in turn (the suite's 15-minute budget has no room for both)
OVERLAP = os.environ.get("HLBP_TEST_OVERLAP") or Hyperparameters.DEFAULT_OVERLAP["sparseloco"]


def rounds_config() -> SimConfig:
    """The run of the round-protocol tests: tiny model, H = 6, windows of 2 to 10 s, 40 rounds at most."""
    return SimConfig(n_full=0, rounds=40, inner_steps=INNER_STEPS, batch_size=4, seq_len=64, round_deadline_s=4.0,
                     min_deadline_s=MIN_DEADLINE_S, max_deadline_s=MAX_DEADLINE_S, seed=7, threads=1,
                     run_id="rounds-test", ttl_s=10.0, overlap=OVERLAP)


def write_keys(workdir: Path, ids: Mapping[str, Identity]) -> dict[str, str]:
    """Key files named after each replica (``<name>.key``, read-only, where the launcher looks for them), drawn by
    a test so that it knows who ranks where; returns each name's peer id."""
    for name, ident in ids.items():
        (workdir / f"{name}.key").write_bytes(ident.to_file_bytes())
        os.chmod(workdir / f"{name}.key", 0o400)
    return {name: ident.peer_id for name, ident in ids.items()}


def by_round(swarm: Swarm) -> dict[int, dict[str, dict[str, Any]]]:
    out: dict[int, dict[str, dict[str, Any]]] = {}
    for name, recs in swarm.records().items():
        for rec in recs:
            out.setdefault(rec["round"], {})[name] = rec  # a restarted peer's later record of a round wins
    return out


def wait_rounds(swarm: Swarm, names: list[str], n: int, timeout_s: float = ROUND_TIMEOUT_S) -> dict[int, dict[str, dict[str, Any]]]:
    """Wait until each named replica has written at least ``n`` round records; returns all records by round."""
    poll(lambda: all(len(swarm.replicas[x].rounds()) >= n for x in names), timeout_s,
         lambda: f"{names} to finish {n} rounds\n" + "\n".join(f"--- {x}\n{swarm.replicas[x].proc.output[-3000:]}"
                                                              for x in names))
    return by_round(swarm)


def state_round(rec: dict[str, Any]) -> int:
    """The round whose state a record's checksums describe: a later one when the peer resynced in that round (a
    straggler that could no longer fetch a round's contributions loads the swarm's latest state instead)."""
    return rec["round"] if rec["state_round"] is None else rec["state_round"]


def rounds_as_of(swarm: Swarm, recs: list[dict[str, Any]], timeout_s: float = ROUND_TIMEOUT_S) -> dict[int, dict[str, dict[str, Any]]]:
    """All records by round, once a has written its record of the state of each record in ``recs`` (a peer writes a
    round's record when it has applied the round, so a faulty peer's may come first: seen as a KeyError on a loaded
    box)."""
    a = swarm.replicas["a"]
    last = max(state_round(rec) for rec in recs)
    poll(lambda: a.rounds() and a.rounds()[-1]["round"] >= last, timeout_s, f"a to record round {last}")
    return by_round(swarm)
