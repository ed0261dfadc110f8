"""Reading a test swarm's round records: by round, waited for with a deadline (the round-protocol tests' helpers)."""

from __future__ import annotations

from typing import Any

from hlbp.peer.sim.launcher import Swarm, poll

ROUND_TIMEOUT_S = 120.0  # a bound on waiting for a few rounds on 2 busy cores, not an expected duration


def by_round(swarm: Swarm) -> dict[int, dict[str, dict[str, Any]]]:
    out: dict[int, dict[str, dict[str, Any]]] = {}
    for name, recs in swarm.records().items():
        for rec in recs:
            out.setdefault(rec["round"], {})[name] = rec  # a restarted peer's later record of a round wins
    return out


def wait_rounds(swarm: Swarm, names: list[str], n: int, timeout_s: float = ROUND_TIMEOUT_S) -> dict[int, dict[str, dict[str, Any]]]:
    """Wait until each named replica has written at least ``n`` round records; returns all records by round."""
    poll(lambda: all(len(swarm.replicas[x].rounds()) >= n for x in names), timeout_s,
         f"{names} to finish {n} rounds\n" + "\n".join(f"--- {x}\n{swarm.replicas[x].proc.output[-3000:]}"
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
