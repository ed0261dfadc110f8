"""A notice that lands just after a round closed widens the next window; a straggler's, a banned or unreachable
peer's and a forged one do not.

The closer's own method on real signed records in a real inbox; only the round loop around it is left out (the
network tests run it: tests/peer/rounds/test_round_faults.py).
"""

from __future__ import annotations

import time

import pytest

from hlbp.peer.rounds.bans import RoundBans
from hlbp.peer.rounds.closer import Closer
from hlbp.peer.rounds.config import RoundConfig
from hlbp.peer.rounds.outer import OuterConfig
from hlbp.peer.rounds.payloads import Payloads
from hlbp.peer.rounds.records import RoundRecords
from hlbp.peer.rounds.rules import Expected
from hlbp.protocol.identity import Identity
from hlbp.protocol.roundwire import KIND_CONTRIB, ContribNotice, round_key, sign

RUN = "late-test"
IDS = {name: Identity.generate() for name in ("me", "on_time", "late", "other")}
PEER = {name: ident.peer_id for name, ident in IDS.items()}


def _closer(closed_window: float, lag_s: float) -> Closer:
    """A closer whose round 3 closed with "on_time" accepted, its first contribution landed ``lag_s`` ago, and
    whose window shrank to 1.5 s after that close."""
    cfg = RoundConfig(run_id=RUN, inner_steps=1, min_deadline_s=1.0, max_deadline_s=30.0)
    records = RoundRecords(None, IDS["me"], None, cfg, None, lambda: 3)
    records.inbox.wanted = lambda key: True
    bans = RoundBans()
    payloads = Payloads(PEER["me"], None, cfg, OuterConfig(), [], [], [], bans.banned, lambda n: None, None)
    closer = Closer(PEER["me"], cfg, 1, records, payloads, bans, lambda: Expected(0), None)
    closer.window = 1.5
    closer.last_close = (3, time.monotonic() - lag_s, closed_window, frozenset({PEER["on_time"]}))
    return closer


def _notice(signer: str, round_: int = 3) -> bytes:
    body = ContribNotice(PEER[signer], round_, 100, {0: "ab" * 32}, {0: 1000}).to_body(RUN)
    return sign(KIND_CONTRIB, body, IDS[signer])


KEY = round_key(RUN, 3, KIND_CONTRIB)


def test_a_near_miss_widens_the_next_window_to_take_it() -> None:
    runner = _closer(closed_window=2.0, lag_s=2.6)
    runner.records.inbox.offer(PEER["on_time"], KEY, _notice("on_time"))  # accepted: no evidence of lateness
    runner.records.inbox.offer(PEER["late"], KEY, _notice("late"))  # lands 2.6 s after the first: 0.6 s past the close
    runner.records.inbox.offer(PEER["me"], KEY, _notice("me"))  # our own notice never counts
    runner.widen_for_late()
    assert runner.window == pytest.approx(1.5 * 2.6 + 1.0, abs=0.1)
    assert runner.last_close is None  # once per closed round
    runner.widen_for_late()
    assert runner.window == pytest.approx(1.5 * 2.6 + 1.0, abs=0.1)


@pytest.mark.parametrize("case", ["straggler", "banned", "unreachable", "forged", "other_round"])
def test_what_does_not_widen_it(case: str) -> None:
    runner = _closer(closed_window=2.0, lag_s=20.0 if case == "straggler" else 2.6)
    if case == "banned":
        runner.bans.ban(3, PEER["late"], "a test ban")
    if case == "unreachable":  # left out because its payload could not be fetched, not because it was late
        runner.payloads.mark_unreachable(3, PEER["late"])
    # forged: "late" pushes a notice signed by another key; other_round: a round-4 notice under round 3's key
    body = _notice("other") if case == "forged" else _notice("late", 4) if case == "other_round" else _notice("late")
    runner.records.inbox.offer(PEER["late"], KEY, body)
    runner.widen_for_late()
    assert runner.window == 1.5
