"""Well-formed, signed, finite poison against real ``hlbp join`` processes: the run survives and learns as if the
attackers were not there.

Two swarms with the same seed, data and honest identities run one after the other on 127.0.0.1:

- poisoned: three honest replicas (a, b, c) and three attackers whose contributions decode cleanly yet lie
  (every value scaled by 10⁶; a 2-bit lookup table of 10³⁰; a NaN lookup table);
- honest: a, b and c alone.

Every honest replica must finish every round (exit status 0), agree on the checksums, ban each attacker, never
accept one, and end each round with exactly the honest swarm's parameters: the same checksums and validation loss.

Both run each round in turn (overlap "none"), so that they differ only by the attackers, and a round in turn is
deterministic: the same three contributions accepted onto the same state give the same bytes. The collection window
is 8 to 20 s (a round closes as soon as every announced contribution is in, so the long window costs nothing while
all keep up): with 2 s, an honest replica a loaded box slowed was left out as a straggler in one swarm and not the
other, and the comparison measured the straggler, not the attack. Under overlap where a phase lands the round's
result depends on timing (measured under eager: the same 3 members every round, last validation losses 2.2 % apart),
so a third swarm runs the attack under the run's default (eager), where the early landing of partial results is new
ground for poison: the same checks, bar the comparison with the honest swarm.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from faulty_peer import program

from hlbp.peer.sim.launcher import SimConfig, Swarm, checksums_agree, poll
from hlbp.protocol.identity import Identity

pytestmark = pytest.mark.slow

HONEST = ("a", "b", "c")
ATTACKERS = {"scaler": "scale:1e6", "bigtable": "bigtable", "nan": "nan"}
ROUNDS = 5  # round 0, then 4 more
ROUND_TIMEOUT_S = 240.0  # a bound on 6 rounds of 7 processes on 2 busy cores, not an expected duration


def _config(overlap: str) -> SimConfig:
    return SimConfig(n_full=0, rounds=ROUNDS, inner_steps=6, batch_size=4, seq_len=64, round_deadline_s=8.0,
                     min_deadline_s=8.0, max_deadline_s=20.0, seed=7, threads=1, run_id="poison-test", ttl_s=10.0,
                     overlap=overlap)


def _keys(workdir: Path, names: dict[str, Identity]) -> None:
    """Give the replicas fixed identities, so both swarms' honest peers read the same data (rank = f(peer id))."""
    workdir.mkdir(parents=True, exist_ok=True)
    for name, ident in names.items():
        path = workdir / f"{name}.key"
        path.write_bytes(ident.to_file_bytes())
        os.chmod(path, 0o400)


def _run(workdir: Path, identities: dict[str, Identity], attackers: dict[str, str],
         overlap: str = "none") -> dict[str, Any]:
    """One swarm to its end: every replica's round records, exit status and peer id."""
    _keys(workdir, identities)
    n = len(HONEST) + len(attackers)
    with Swarm(_config(overlap), workdir) as sw:
        sw.start()
        for name in HONEST:
            sw.add(name, "--wait-replicas", str(n))
        for name, fault in attackers.items():
            sw.add(name, "--wait-replicas", str(n), program=program(fault))
        poll(lambda: all(not sw.replicas[x].proc.alive for x in HONEST), ROUND_TIMEOUT_S,
             lambda: "the honest replicas to finish their rounds\n"
             + "\n".join(f"--- {x}\n{sw.replicas[x].proc.output[-3000:]}" for x in HONEST))
        return {
            "records": sw.records(),
            "exit": {x: sw.replicas[x].proc.popen.returncode for x in HONEST},
            "ids": {x: identities[x].peer_id for x in identities},
            "logs": {x: sw.replicas[x].proc.output for x in sw.replicas},
        }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, dict[str, Any]]]:
    identities = {name: Identity.generate() for name in (*HONEST, *ATTACKERS)}
    poisoned = _run(tmp_path_factory.mktemp("poisoned"), identities, ATTACKERS)
    honest = _run(tmp_path_factory.mktemp("honest"), {x: identities[x] for x in HONEST}, {})
    eager = _run(tmp_path_factory.mktemp("eager"), identities, ATTACKERS, overlap="")  # the default: eager
    yield {"poisoned": poisoned, "honest": honest, "poisoned, eager": eager}


def _by_round(records: dict[str, list[dict[str, Any]]], names: tuple[str, ...]) -> dict[int, dict[str, dict]]:
    out: dict[int, dict[str, dict]] = {}
    for name in names:
        for rec in records[name]:
            out.setdefault(rec["round"], {})[name] = rec
    return out


@pytest.mark.parametrize("which", ["poisoned", "poisoned, eager"])
def test_honest_replicas_finish_every_round_in_agreement(runs: dict[str, dict[str, Any]], which: str) -> None:
    poisoned = runs[which]
    assert poisoned["exit"] == {x: 0 for x in HONEST}, {x: poisoned["logs"][x][-2000:] for x in HONEST}
    rounds = _by_round(poisoned["records"], HONEST)
    assert sorted(rounds) == list(range(ROUNDS))
    for r, recs in rounds.items():
        assert set(recs) == set(HONEST) and checksums_agree(recs.values()), (r, recs)
        assert all(rec["in_sync"] and not rec["refused"] for rec in recs.values()), (r, recs)
    losses = [rounds[r]["a"]["val_loss"] for r in range(ROUNDS)]
    assert losses[-1] < losses[0] - 0.5, losses


@pytest.mark.parametrize("which", ["poisoned", "poisoned, eager"])
def test_every_attacker_is_banned_and_never_accepted(runs: dict[str, dict[str, Any]], which: str) -> None:
    poisoned = runs[which]
    ids = poisoned["ids"]
    rounds = _by_round(poisoned["records"], HONEST)
    banned = {p for recs in rounds.values() for rec in recs.values() for p in rec["banned"]}
    assert {ids[x] for x in ATTACKERS} <= banned, (banned, ids)
    assert not ({ids[x] for x in HONEST} & banned)
    for recs in rounds.values():
        assert all(rec["members"] <= len(HONEST) for rec in recs.values()), recs
    for name in ATTACKERS:
        assert not any(rec["accepted"] for rec in poisoned["records"][name]), name
    logs = "\n".join(poisoned["logs"].values())  # whoever coordinated that round (an attacker runs honest code)
    for name in ATTACKERS:
        assert f"rejected the contribution of {ids[name][:16]}" in logs, name


def test_the_poisoned_swarm_ends_each_round_exactly_where_the_honest_swarm_does(
        runs: dict[str, dict[str, Any]]) -> None:
    poisoned = _by_round(runs["poisoned"]["records"], HONEST)
    honest = _by_round(runs["honest"]["records"], HONEST)
    assert runs["honest"]["exit"] == {x: 0 for x in HONEST}
    assert sorted(honest) == sorted(poisoned) == list(range(ROUNDS))
    for r in range(ROUNDS):
        for name in HONEST:
            got, want = poisoned[r][name], honest[r][name]
            # the premise: both swarms accepted the same three contributions (a straggler would break it, not poison)
            assert (got["members"], got["accepted"]) == (want["members"], want["accepted"]) == (len(HONEST), True), (
                r, name, got, want)
            assert got["checksums"] == want["checksums"] and got["val_loss"] == want["val_loss"], (r, name, got, want)
    last = honest[ROUNDS - 1]["a"]["val_loss"]
    print(f"val loss after round {ROUNDS - 1}: poisoned and honest swarms both {last:.4f}")
