"""The collection window a peer learned from the run's arrivals (hlbp.peer.rounds.state.LearnedWindow) is kept in
its checkpoint: a resumed peer's closer waits that window, not the manifest's first one, which had made it close a
round later than the coordinators it rejoined. Read back from a hostile file it is dropped, and the closer keeps it
within the manifest's bounds."""

from __future__ import annotations

from pathlib import Path

import pytest

from hlbp.peer.rounds.bans import RoundBans
from hlbp.peer.rounds.closer import Closer
from hlbp.peer.rounds.config import RoundConfig
from hlbp.peer.rounds.outer import OuterConfig
from hlbp.peer.rounds.payloads import Payloads
from hlbp.peer.rounds.persist import Checkpoints
from hlbp.peer.rounds.records import RoundRecords
from hlbp.peer.rounds.rules import Expected
from hlbp.peer.rounds.state import LearnedWindow
from hlbp.protocol.identity import Identity

RUN = "window-run"
CFG = RoundConfig(run_id=RUN, inner_steps=1, deadline_s=4.0, min_deadline_s=1.0, max_deadline_s=10.0)


def _closer(learned: LearnedWindow | None) -> Closer:
    me = Identity.generate()
    records = RoundRecords(None, me, None, CFG, None, lambda: 0)
    bans = RoundBans()
    payloads = Payloads(me.peer_id, None, CFG, OuterConfig(), [], [], [], bans.banned, lambda n: None, None)
    return Closer(me.peer_id, CFG, 1, records, payloads, bans, lambda: Expected(0), None, learned=learned)


def test_the_closer_waits_the_learned_window_within_the_manifests_bounds() -> None:
    assert _closer(None).window == 4.0  # nothing learned: the manifest's first window
    learned = LearnedWindow()
    closer = _closer(learned)
    closer.window = 2.0  # what adapt_window gave after a round
    assert learned.seconds == 2.0 and closer.window == 2.0  # the state's object holds it, for the checkpoint
    learned.seconds = 0.1
    assert closer.window == 1.0
    learned.seconds = 99.0
    assert closer.window == 10.0


@pytest.mark.parametrize("raw", [None, "2.0", True, float("nan"), float("inf"), -2.0, 0, [2.0], {"s": 2}])
def test_a_saved_window_that_is_not_a_positive_finite_number_is_dropped(raw: object) -> None:
    learned = LearnedWindow(3.0)
    learned.load_json(raw)
    assert learned.seconds is None


def test_a_resumed_replica_waits_the_window_it_had_learned(tmp_path: Path, tiny_replica) -> None:
    trainer, state = tiny_replica
    before = state()
    before.round = 9
    _closer(before.window).window = 2.25
    path = tmp_path / "rounds.safetensors"
    Checkpoints(path, 60.0, trainer, RUN).save(before)
    after = state()
    closer = _closer(after.window)  # built before the resume, as the round loop builds it
    assert closer.window == 4.0
    assert Checkpoints(path, 60.0, trainer, RUN).resume(after) and after.round == 9
    assert closer.window == 2.25


@pytest.mark.parametrize("in_sync", [True, False])
def test_a_resumed_state_is_in_sync_only_if_it_was_saved_so(tmp_path: Path, tiny_replica, in_sync: bool) -> None:
    """A state saved out of sync (its round's apply failed, or a stop came before the resync ended) is resumed out
    of sync: the round loop's start then neither serves it nor votes with it, and syncs."""
    trainer, state = tiny_replica
    before = state()
    before.round, before.in_sync = 4, in_sync
    path = tmp_path / "rounds.safetensors"
    Checkpoints(path, 60.0, trainer, RUN).save(before)
    after = state()
    assert after.in_sync  # a fresh state
    assert Checkpoints(path, 60.0, trainer, RUN).resume(after) and after.in_sync is in_sync
