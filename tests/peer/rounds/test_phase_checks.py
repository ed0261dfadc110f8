"""The inner phase's look-ups: they never wait on the DHT, and a phase that started behind the others catches up.

Under overlap a replica whose notice for round r came too late starts phase r+1 at that late notice. The exchange
thread, finding round r closed without us, marks phase r+1 (``catch_up_round``) while it runs, and the phase then
ends, after at least one step, as soon as others announce round r+1. A real tiny model trains here; the round's
records are what the subclass answers, as a DHT read would.
"""

from __future__ import annotations

import threading

import torch

from hlbp.peer.model.decoder import build_model, preset
from hlbp.peer.rounds.loop import ReplicaBase, RoundConfig, RoundStats
from hlbp.peer.rounds.outer import OuterConfig
from hlbp.peer.train.trainer import InnerTrainer, OptimConfig
from hlbp.protocol.identity import Identity

STEPS = 150  # far more steps than a marked phase makes (it ends within PHASE_CHECK_S of the mark)


class _Replica(ReplicaBase):
    """Only the inner phase runs; ``others_announced`` stands for the notices others published for the round."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.others_announced = False
        self.waits: list[bool] = []  # the ``wait`` of every look-up the phase made

    def run_round(self) -> RoundStats:
        return RoundStats(round=self.round)

    def round_closed(self, r: int, wait: bool = True) -> bool:
        self.waits.append(wait)
        return False

    def round_started(self, r: int, wait: bool = True) -> bool:
        self.waits.append(wait)
        return self.others_announced


class _LateExchange:
    """Wraps the phase's trainer: after its step ``at`` of round ``r``, others announce the round, and (``mark``)
    the exchange thread finds our previous notice was too late, as it does from the background while the phase
    runs."""

    def __init__(self, r: int, at: int, mark: bool) -> None:
        self.r, self.at, self.mark = r, at, mark
        self.replica: _Replica | None = None
        self.trainer: InnerTrainer | None = None
        self.steps = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self.trainer, name)

    def train_step(self) -> None:
        assert self.trainer is not None and self.replica is not None
        self.trainer.train_step()
        self.steps += 1
        if self.replica.round == self.r and self.steps == self.at:
            self.replica.others_announced = True
            if self.mark:
                self.replica.phase.catch_up_round = self.r


def _batches(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 256, (1, 9), generator=g)
    return x[:, :-1], x[:, 1:]


def _replica(hook: _LateExchange) -> _Replica:
    torch.manual_seed(0)
    model = build_model(preset("tiny", vocab_size=256))
    trainer = InnerTrainer(model, OptimConfig(lr=1e-3, warmup_steps=1, total_steps=STEPS), _batches,
                           torch.device("cpu"))
    names = [n for n, _ in model.named_parameters()]
    replica = _Replica(None, Identity.generate(), None, trainer, OuterConfig(), [names],  # type: ignore[arg-type]
                       RoundConfig(run_id="t", inner_steps=STEPS, overlap="eager"), threading.Event())
    hook.replica, hook.trainer = replica, trainer
    replica.phase.trainer = hook  # type: ignore[assignment]
    replica.state.round = hook.r
    return replica


def test_a_phase_marked_late_while_it_runs_ends_once_others_announce_it() -> None:
    hook = _LateExchange(r=5, at=3, mark=True)
    replica = _replica(hook)
    steps, tokens = replica.phase.run(5)
    assert 3 <= steps < STEPS and tokens == 8 * steps  # it contributes the steps it made, and no more
    assert replica.waits and not any(replica.waits)  # every look-up answered from the last poll and the pushes


def test_an_unmarked_phase_runs_all_its_steps_although_others_announced() -> None:
    # a replica on time keeps training past others' notices: the collection window is there for it
    replica = _replica(_LateExchange(r=5, at=3, mark=False))
    steps, _tokens = replica.phase.run(5)
    assert steps == STEPS
    assert not any(replica.waits)


def test_a_mark_for_another_round_does_not_cut_this_phase() -> None:
    hook = _LateExchange(r=5, at=3, mark=False)
    replica = _replica(hook)
    replica.phase.catch_up_round = 4  # a phase already past
    assert replica.phase.run(5)[0] == STEPS


def test_a_peer_that_pushes_its_checksums_is_pushed_our_next_records() -> None:
    # a restarted peer sits its first round out (no notice) and pushes its checksums to the round's members: from
    # then on they push it their records, so its catch-up phase hears of the next round's notices at once
    from hlbp.protocol.roundwire import KIND_CONTRIB, checks_key, round_key

    replica = _replica(_LateExchange(r=5, at=3, mark=False))
    replica.state.round = 6
    newcomer, other = Identity.generate().peer_id, Identity.generate().peer_id
    replica.records.on_push(other, round_key("t", 6, KIND_CONTRIB), b"a notice")  # a notice counts once parsed, not here
    assert replica.records.pushed_to() == set()
    replica.records.on_push(newcomer, checks_key("t"), b"its checksums")
    assert replica.records.pushed_to() == {newcomer} and replica.records.inbox.entries(checks_key("t")) == {newcomer: b"its checksums"}
    replica.records.on_push(replica.me, checks_key("t"), b"ours")  # never ourselves
    replica.records.on_push(other, checks_key("other-run"), b"another run's")  # unwanted: not kept, so not live
    assert replica.records.pushed_to() == {newcomer}
    replica.state.round = 9  # live means seen in the last two rounds
    assert replica.records.pushed_to() == set()
