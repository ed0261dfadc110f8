"""Two peers serving one stage in the same steps, on real hivemind P2P daemons on loopback: a driver (stage 0), two
peers of stage 1 and a last stage, with the lossless dense fp32 codec.

What must hold: the driver splits each step's micro-batches between the two stage-1 peers; at the step's end they
trade gradients and step with the same bits, so their weights stay bit-identical; the update equals the one a single
stage-1 peer makes on the same batches (up to the order of one addition); only the peer that led the trade counts
the step for its round gate (the other is a mirror); and when one of the two stops, the next steps run through the
other alone."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import pytest
import torch
from stage_parts import CONFIG3, dense_codec, stage_workers, started_dhts

from hlbp.peer.sim.launcher import poll
from hlbp.peer.swarm import shares
from hlbp.peer.swarm.driver import Driver, DriverConfig
from hlbp.peer.swarm.gate import RoundGate
from hlbp.peer.swarm.routing import Candidate
from hlbp.peer.swarm.server import StageServer
from hlbp.peer.swarm.worker import StageWorker
from hlbp.peer.train.trainer import OptimConfig, lr_at
from hlbp.protocol.gradshare import encode_share
from hlbp.protocol.stagewire import StageMessage, decode_message, encode_message

OPTIM = OptimConfig(lr=3e-3, warmup_steps=1, total_steps=20)


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(n):
        x = torch.randint(0, CONFIG3.vocab_size, (8, 17), generator=gen)
        out.append((x[:, :-1], x[:, 1:]))
    return out


@contextmanager
def _swarm(middles: int, trade_timeout_s: float = 20.0,
           ) -> Iterator[tuple[Driver, list[StageServer], StageServer, list[StageWorker]]]:
    """A driver, ``middles`` stage-1 servers (siblings of each other) and a last stage, all from the initial
    state; the driver spreads each step over up to ``middles`` (at least 2) peers of stage 1."""
    with started_dhts(2 + middles) as dhts, ExitStack() as stack:
        workers = stage_workers(OPTIM, 0, *[1] * middles, 2, n_stages=3)
        upstream: set[str] = set()
        mids: list[StageServer] = []
        for i in range(middles):
            server = StageServer(dhts[1 + i], workers[1 + i], dense_codec(), CONFIG3.vocab_size,
                                 lambda p: p in upstream, 4096, gate=RoundGate(),
                                 sibling=lambda p: p in {m.peer_id for m in mids}, trade_timeout_s=trade_timeout_s)
            mids.append(server)
            stack.callback(server.close)
        last = StageServer(dhts[-1], workers[-1], dense_codec(), CONFIG3.vocab_size,
                           lambda p: p in upstream or p in {m.peer_id for m in mids}, 4096)
        stack.callback(last.close)
        cfg = DriverConfig(micro_batches=4, stage_peers=max(2, middles), max_norm=1.0)
        driver = Driver(dhts[0], workers[0], dense_codec(), CONFIG3.vocab_size, cfg,
                        lambda: [[Candidate(m.peer_id, 100.0) for m in mids], [Candidate(last.peer_id, 100.0)]],
                        4096)
        stack.callback(driver.close)
        upstream.add(driver.peer_id)
        yield driver, mids, last, workers


def _params(worker: StageWorker) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in worker.stage.named_parameters()}


def _same_update(got: torch.Tensor, want: torch.Tensor, init: torch.Tensor, name: str) -> None:
    """``got`` made the update ``want`` made from ``init`` but for the order of float additions: AdamW divides by
    the gradient's own scale, so an entry whose gradient is near zero may move differently; on average the two
    differ by a millionth of the update (a missing part of the gradient moves them apart by a tenth or more)."""
    diff = (got - want).abs()
    update = (want - init).abs().mean()
    assert float(update) > 0, name
    assert float(diff.mean()) <= 1e-3 * float(update), (name, float(diff.mean()), float(update))
    assert float((diff > 1e-5).float().mean()) <= 1e-3, (name, float((diff > 1e-5).float().mean()))


def _train(driver: Driver, batches: list[tuple[torch.Tensor, torch.Tensor]], end: bool = True) -> list[list[str]]:
    """The steps of ``batches``, the last one marked as the round's end if ``end`` (the servers' round gates then
    close: no round loop opens them here)."""
    chains = []
    for step, (x, y) in enumerate(batches):
        result = driver.train_step(x, y, step, lr_at(step, OPTIM), round_end=end and step == len(batches) - 1,
                                   inner=step)
        chains.append(result.chain)
    return chains


@pytest.mark.timeout(240)
def test_two_peers_of_a_stage_split_each_step_and_stay_bit_identical_to_each_other() -> None:
    batches = _batches(3)
    with _swarm(1) as (driver, _mids, _last, workers):
        init, init_last = _params(workers[1]), _params(workers[2])
        _train(driver, batches)
        poll(lambda: _mids[0].counters.steps_applied == 3 and _last.counters.steps_applied == 3, 30, "3 steps")
        alone = _params(workers[1])
        alone_last = _params(workers[2])
    with _swarm(2) as (driver, mids, last, workers):
        _train(driver, batches)
        # the mirror applies when the leader's apply reaches it, after the driver's step returned
        poll(lambda: all(m.counters.steps_applied == 3 for m in mids) and last.counters.steps_applied == 3, 30,
             lambda: f"every stage peer to apply 3 steps: {[m.counters.steps_applied for m in mids]}")
        a, b = _params(workers[1]), _params(workers[2])
        assert driver.counters.steps == 3 and driver.counters.microbatches_retried == 0
        assert all(m.counters.forwards > 0 for m in mids), [m.counters.forwards for m in mids]
        assert sum(m.counters.forwards for m in mids) == 3 * 4
        for name in a:
            assert torch.equal(a[name].view(torch.int32), b[name].view(torch.int32)), name
            _same_update(a[name], alone[name], init[name], name)
        for name, t in _params(workers[3]).items():
            _same_update(t, alone_last[name], init_last[name], name)
        assert workers[1].lineage == workers[2].lineage
        assert [m.trades.traded for m in mids] == [3, 3]
        gates = [m.gate for m in mids]
        assert all(g is not None for g in gates)
        counted = sorted(g.take()[0] for g in gates if g is not None)
        assert counted == [0, 3]  # the leader counts the phase's steps, the mirror none


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stops", ["leader", "mirror"])
def test_when_one_of_the_two_stops_the_other_serves_the_stage_alone(stops: str) -> None:
    batches = _batches(4)
    with _swarm(2) as (driver, mids, last, _workers):
        _train(driver, batches[:2], end=False)
        poll(lambda: all(m.counters.steps_applied == 2 for m in mids), 30, "both stage-1 peers to apply 2 steps")
        leader = min(mids, key=lambda m: m.peer_id)  # the finish goes through the lower id
        mirror = next(m for m in mids if m is not leader)
        gone, other = (leader, mirror) if stops == "leader" else (mirror, leader)
        gone.close()
        for step, (x, y) in enumerate(batches[2:], start=2):
            result = driver.train_step(x, y, step, lr_at(step, OPTIM), inner=step)
            assert result.chain[0] == other.peer_id
        assert driver.counters.steps == 4 and driver.counters.failures >= 1
        poll(lambda: other.counters.steps_applied == 4 and last.counters.steps_applied == 4, 30,
             lambda: f"the remaining peers to apply 4 steps: {other.counters.steps_applied}, "
                     f"{last.counters.steps_applied}")
        assert other.trades.traded == 2  # the two steps before the stop; alone it trades nothing


@pytest.mark.timeout(300)
def test_a_refused_share_leaves_the_update_one_peers_and_the_refused_side_out_of_the_phase(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One check of the third step's trade refuses (as a share past the norm bound is): whichever of the two refused,
    the step and the next one end with one peer's update, and the driver routes around the peer that fell out."""
    batches = _batches(4)
    with _swarm(1) as (driver, mids, last, workers):
        _train(driver, batches, end=False)
        poll(lambda: mids[0].counters.steps_applied == 4 and last.counters.steps_applied == 4, 30, "4 steps")
        init = {n: t for w in stage_workers(OPTIM, 0, 1, 2, n_stages=3) for n, t in _params(w).items()}
        alone = {n: t for w in workers for n, t in _params(w).items()}
    calls = {"n": 0}
    honest = shares.share_fault

    def refuse_once(*args: float) -> str | None:
        calls["n"] += 1
        return "a share refused by the test" if calls["n"] == 5 else honest(*args)

    monkeypatch.setattr(shares, "share_fault", refuse_once)
    with _swarm(2) as (driver, mids, last, workers):
        _train(driver, batches, end=False)
        leader = min(mids, key=lambda m: m.peer_id)
        poll(lambda: leader.counters.steps_applied == 4 and last.counters.steps_applied == 4, 30, "4 steps")
        assert calls["n"] >= 5 and driver.counters.failures >= 1 and driver.counters.steps == 4
        lead = workers[1 + mids.index(leader)]
        got = {n: t for w in (workers[0], lead, workers[3]) for n, t in _params(w).items()}
    for name, t in got.items():
        _same_update(t, alone[name], init[name], name)


@pytest.mark.timeout(120)
def test_a_share_that_names_a_peer_outside_the_stage_is_refused_and_its_sender_banned() -> None:
    with _swarm(2) as (driver, mids, _last, workers):
        a, b = mids
        body = encode_share([0], 4, workers[2].gradients())
        lie = StageMessage("share", session=1, step=1, count=4, peers=(a.peer_id, b.peer_id, driver.peer_id))
        b.links.dial(a.peer_id).send(encode_message(lie, body))  # b, a peer of the stage, asks a to send to the driver
        poll(lambda: a.counters.frames_refused == 1, 30, "the share refused")
        assert a.bans.banned(b.peer_id, time.monotonic()) and a.trades.traded == 0


class _Unsent:
    """A stream whose frames never leave."""

    def send(self, data: bytes) -> None:
        pass


class _DropsTo:
    """A stage peer's links as its trades use them (the test's wrapper): nothing it trades reaches ``peer``."""

    def __init__(self, links: Any, peer: str) -> None:
        self.links, self.peer = links, peer

    def dial(self, peer: str, **kwargs: Any) -> Any:
        return _Unsent() if peer == self.peer else self.links.dial(peer, **kwargs)


@pytest.mark.timeout(300)
def test_a_trade_of_three_that_fails_halfway_is_rerun_by_the_other_two_without_refusing_each_other() -> None:
    """Three peers serve stage 1; the highest one's share never reaches the one that leads the trade, so the other
    peer completes the trade (it holds the sum of all three parts) while the leader waits for the missing share,
    names that peer, and the driver re-runs the step through the two left. The peer that completed takes its own
    part back: the two trade again, neither refuses the other, and they end every step with the same bits and one
    peer's update."""
    batches = _batches(3)
    with _swarm(1) as (driver, mids, last, workers):
        init = {n: t for w in workers for n, t in _params(w).items()}
        _train(driver, batches, end=False)
        poll(lambda: mids[0].counters.steps_applied == 3 and last.counters.steps_applied == 3, 30, "3 steps")
        alone = {n: t for w in workers for n, t in _params(w).items()}
    with _swarm(3, trade_timeout_s=3.0) as (driver, mids, last, workers):
        leader, other, dropper = sorted(mids, key=lambda m: m.peer_id)  # the finish goes through the lowest id
        dropper.trades.links = _DropsTo(dropper.trades.links, leader.peer_id)
        x, y = batches[0]
        first = driver.train_step(x, y, 0, lr_at(0, OPTIM), inner=0)
        assert dropper.peer_id not in first.chain and driver.counters.failures >= 1, first
        assert driver.counters.microbatches_retried > 0
        for step, (x, y) in enumerate(batches[1:], start=1):
            driver.train_step(x, y, step, lr_at(step, OPTIM), inner=step)
        poll(lambda: leader.counters.steps_applied == 3 and other.counters.steps_applied == 3
             and last.counters.steps_applied == 3, 30,
             lambda: f"two stage-1 peers to apply 3 steps: {[m.counters.steps_applied for m in mids]}")
        assert (leader.trades.refused, other.trades.refused) == (0, 0)
        assert not leader.bans.banned(other.peer_id, time.monotonic())
        assert not other.bans.banned(leader.peer_id, time.monotonic())
        a, b = (_params(workers[1 + mids.index(m)]) for m in (leader, other))
        got = {n: t for w in (workers[0], workers[1 + mids.index(leader)], workers[4]) for n, t in _params(w).items()}
    for name in a:
        assert torch.equal(a[name].view(torch.int32), b[name].view(torch.int32)), name
    for name, t in got.items():
        _same_update(t, alone[name], init[name], name)


def _op(frame: bytes) -> str:
    return decode_message(frame, 1 << 30, 1 << 30)[0].op


class _Tapped:
    """A stage peer's links as its trades use them (the test's wrapper): each frame it sends ``peer`` is kept in
    ``frames``; those of op ``hold`` are kept only, the others sent too."""

    def __init__(self, links: Any, peer: str, hold: str = "") -> None:
        self.links, self.peer, self.hold = links, peer, hold
        self.frames: list[bytes] = []

    def dial(self, peer: str, **kwargs: Any) -> Any:
        return self.links.dial(peer, **kwargs) if peer != self.peer else self

    def send(self, data: bytes) -> None:
        self.frames.append(data)
        if _op(data) != self.hold:
            self.links.dial(self.peer).send(data)


@pytest.mark.timeout(300)
def test_a_share_resent_after_its_trade_completed_undoes_nothing_and_bans_no_one() -> None:
    """Three peers serve stage 1. After the first step's trade completed at the middle one, and before the leader's
    apply reaches it, the highest one sends it its share of that trade again (a peer with a valid key replaying a
    frame). The middle peer holds it for a re-run's leader and keeps the trade: it applies the leader's step as a
    mirror, refuses and bans no one, and ends every step with the leader's bits."""
    batches = _batches(2)
    with _swarm(3) as (driver, mids, last, workers):
        leader, mirror, replayer = sorted(mids, key=lambda m: m.peer_id)
        recorded = _Tapped(replayer.trades.links, mirror.peer_id)
        replayer.trades.links = recorded
        applies = _Tapped(leader.trades.links, mirror.peer_id, hold="apply")
        leader.trades.links = applies
        x, y = batches[0]
        first = driver.train_step(x, y, 0, lr_at(0, OPTIM), inner=0)
        assert driver.counters.failures == 0 and driver.counters.microbatches_retried == 0, first
        # the leader's share went out, its apply is held: the trade completed at the mirror, the step is not applied
        poll(lambda: "apply" in [_op(f) for f in applies.frames], 30,
             "the leader's apply of the first step")
        assert mirror.trades.traded == 1 and mirror.counters.steps_applied == 0
        assert [_op(f) for f in recorded.frames] == ["share"]
        replayer.links.dial(mirror.peer_id).send(recorded.frames[0])
        poll(lambda: mirror.trades.deferred == 1, 30, "the resent share to reach the mirror's trades")
        leader.trades.links = applies.links
        for frame in applies.frames:
            if _op(frame) == "apply":
                leader.links.dial(mirror.peer_id).send(frame)
        x, y = batches[1]
        driver.train_step(x, y, 1, lr_at(1, OPTIM), inner=1)
        poll(lambda: all(m.counters.steps_applied == 2 for m in mids) and last.counters.steps_applied == 2, 30,
             lambda: f"every stage-1 peer to apply 2 steps: {[m.counters.steps_applied for m in mids]}")
        assert [m.trades.refused for m in mids] == [0, 0, 0]
        now = time.monotonic()
        assert not any(m.bans.banned(o.peer_id, now) for m in mids for o in mids if o is not m)
        assert not mirror.trades.missed
        a, b = (_params(workers[1 + mids.index(m)]) for m in (leader, mirror))
    for name in a:
        assert torch.equal(a[name].view(torch.int32), b[name].view(torch.int32)), name
