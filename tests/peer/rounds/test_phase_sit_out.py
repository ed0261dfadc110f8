"""The inner phase right after a state sync (hlbp.peer.rounds.phase.InnerPhase.run): a peer whose own trainer
runs the phase sits out a round others already announce; a stage server, whose steps its driver sends, never does."""

from __future__ import annotations

import threading

from hlbp.peer.rounds.config import RoundConfig
from hlbp.peer.rounds.phase import InnerPhase


def _phase(sit_out: bool, calls: list[int]) -> InnerPhase:
    def steps(r: int) -> tuple[int, int]:
        calls.append(r)
        return 6, 6 * 256

    return InnerPhase(None, RoundConfig(run_id="t", inner_steps=6), threading.Event(),
                      closed=lambda r, wait: False, started=lambda r, wait: True, base=dict,
                      after_step=lambda r, s: None, steps=steps, sit_out=sit_out)


def test_a_synced_peer_sits_out_an_announced_round_only_when_it_runs_its_own_phase() -> None:
    calls: list[int] = []
    own = _phase(True, calls)
    own.just_synced = True
    assert own.run(3) == (0, 0) and calls == []  # taken with weight 0
    assert own.run(4) == (6, 1536) and calls == [4]  # the next round with everybody

    calls.clear()
    driven = _phase(False, calls)
    driven.just_synced = True
    # the driver's steps of round 3 arrive at this server whatever it did: they count in round 3's phase, not the
    # next one's (where they would run on parameters the round's result replaced: a contribution of nothing)
    assert driven.run(3) == (6, 1536) and calls == [3]
