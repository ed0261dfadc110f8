"""The inner phase (hlbp.peer.rounds.phase.InnerPhase): right after a state sync a peer whose own trainer runs the
phase sits out a round others already announce, and a stage server, whose steps its driver sends, never does; a
phase the others wait on ends early."""

from __future__ import annotations

import threading
import time

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


class _SlowTrainer:
    """Steps of 0.2 s each, 256 tokens a step: the phase checks the round between them every 0.25 s."""

    def __init__(self) -> None:
        self.tokens = 0

    def train_step(self) -> float:
        time.sleep(0.2)
        self.tokens += 256
        return 0.0


def test_a_phase_the_others_wait_on_ends_after_a_step_with_what_it_made() -> None:
    asked: list[int] = []

    def run(holding: bool) -> tuple[int, int]:
        phase = InnerPhase(_SlowTrainer(), RoundConfig(run_id="t", inner_steps=6), threading.Event(),
                           closed=lambda r, wait: False, started=lambda r, wait: True, base=dict,
                           after_step=lambda r, s: None, holding_up=lambda r: asked.append(r) or holding)
        return phase.run(4)

    assert run(False) == (6, 6 * 256)  # nobody waits on us: the whole phase
    steps, tokens = run(True)
    # the first check comes before any step (nothing to contribute yet), the next one 0.25 s later, by step 2
    assert 1 <= steps <= 2 and tokens == steps * 256, steps
    assert set(asked) == {4}
