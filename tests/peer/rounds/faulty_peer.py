"""``hlbp join`` as a misbehaving full replica (or stage peer, ``--role stage``: its round runner is wrapped the same
way): the faulty peers of the fault tests, started as real processes.

Usage: ``python faulty_peer.py FAULT join ...``, where FAULT is one of :data:`FAULTS` (``name`` or ``name:arg``).
Each fault wraps one part of the replica's round loop, as torchft's fault injection wraps a process group: the
trainer (a straggler), the payload encoder (bytes that lie), the state sync (a member that dies before it answers
the verification), the closer's choice of what to accept (a lying coordinator) or the round records (lost DHT
stores). The protocol's code calls no hook; the wrapping happens here, through the test entry point
:func:`hlbp.peer.node.session.run_join`. Tests build the command with :func:`program`.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from hlbp.peer.net.transport import PUSH_RATE, STATE_RATE
from hlbp.peer.rounds.outer import Contribution


class Delegate:
    """Wraps a part of the round loop: every attribute not overridden is the wrapped part's."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class SlowTrainer(Delegate):
    """A straggler: sleeps after every inner step."""

    def __init__(self, inner: Any, seconds: float) -> None:
        super().__init__(inner)
        self.seconds = seconds

    def train_step(self) -> Any:
        out = self.inner.train_step()
        time.sleep(self.seconds)
        return out


class CorruptEncoder(Delegate):
    """Serves bytes that match its signed digest but do not decode (everything after the first 64 flipped)."""

    def encode(self, r: int, s: int, c: Contribution) -> bytes:
        blob = self.inner.encode(r, s, c)
        return blob[:64] + bytes(b ^ 0x5A for b in blob[64:])


class OversizeEncoder(Delegate):
    """Announces and serves a payload one byte above the receivers' limit."""

    def encode(self, r: int, s: int, c: Contribution) -> bytes:
        blob = self.inner.encode(r, s, c)
        return blob + bytes(self.inner.limits[s] + 1 - len(blob))


class RewriteEncoder(Delegate):
    """A well-formed, finite lie: each sparse tensor rewritten before encoding, so the payload decodes cleanly
    (our own error feedback keeps the true contribution)."""

    def __init__(self, inner: Any, rewrite: Callable[[Any], Any]) -> None:
        super().__init__(inner)
        self.rewrite = rewrite

    def encode(self, r: int, s: int, c: Contribution) -> bytes:
        lie = replace(c, tensors={n: self.rewrite(t) for n, t in c.tensors.items()})
        return self.inner.encode(r, s, lie)


def scaled(factor: float) -> Callable[[Any], Any]:
    """Every decoded value multiplied by ``factor`` (lookup table and shift scaled)."""

    def rewrite(t: Any) -> Any:
        if t.table is None:
            return replace(t, values=t.values * factor)
        return replace(t, table=(t.table * factor).float(), shift=float(torch.tensor(t.shift * factor)))

    return rewrite


class NearBoundEncoder(Delegate):
    """A poisoner that stays under the bounds: every contribution sign-flipped and scaled to ``ratio`` times its
    shard's parameter norm (the guard refuses above ``max_contribution_ratio``, 8 by default)."""

    def __init__(self, inner: Any, runner: Any, ratio: float) -> None:
        super().__init__(inner)
        self.runner, self.ratio = runner, ratio

    def encode(self, r: int, s: int, c: Contribution) -> bytes:
        from hlbp.peer.rounds import guard

        target = self.ratio * guard.scale({n: self.runner.state.anchor[n] for n in self.runner.shards[s]})
        factor = -target / max(guard.contribution_norm(c), 1e-12)
        lie = replace(c, tensors={n: scaled(factor)(t) for n, t in c.tensors.items()})
        print(f"near-bound contribution to round {r}", flush=True)
        return self.inner.encode(r, s, lie)


def big_table(t: Any) -> Any:
    """An outsized 2-bit lookup table: decoded magnitudes about 1e30."""
    if t.table is None:
        return replace(t, values=torch.full_like(t.values, 1e30))
    return replace(t, table=torch.tensor([-1e30, -1e29, 1e29, 1e30], dtype=torch.float32))


def nan_table(t: Any) -> Any:
    """NaN in the lookup table."""
    if t.table is None:
        return replace(t, values=torch.full_like(t.values, float("nan")))
    return replace(t, table=torch.full((4,), float("nan")))


class FreezingEncoder(Delegate):
    """Freezes its own process (SIGSTOP: alive, not answering) half a second after building its payload of round
    ``round``, so that others are fetching from it when the test acts."""

    def __init__(self, inner: Any, round_: int) -> None:
        super().__init__(inner)
        self.round = round_

    def encode(self, r: int, s: int, c: Contribution) -> bytes:
        blob = self.inner.encode(r, s, c)
        if r == self.round and s == 0:
            print(f"freezing in round {r}", flush=True)
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGSTOP)).start()
        return blob


class DyingSync(Delegate):
    """Applies round ``round`` (its contribution accepted), stalls two seconds while the others fetch from it,
    then SIGKILLs itself before it publishes its checksums."""

    def __init__(self, inner: Any, round_: int) -> None:
        super().__init__(inner)
        self.round = round_

    def publish(self, state: Any, mine: Any, to: Any = frozenset(), sampled: bool = False) -> None:
        if mine.round == self.round:
            print(f"dying after applying round {mine.round}", flush=True)
            time.sleep(2.0)  # the fault's own behaviour (a member stalled, then gone), not a synchronisation
            os.kill(os.getpid(), signal.SIGKILL)
        self.inner.publish(state, mine, to, sampled)


class UsurpingCloser(Delegate):
    """Publishes its own accepted set of every round as soon as its exchange starts, whoever's turn it is: one
    holding only its own contribution, or (``empty``) none at all; then closes the round as an honest peer would."""

    def __init__(self, inner: Any, empty: bool) -> None:
        super().__init__(inner)
        self.empty = empty

    def close(self, r: int) -> Any:
        from hlbp.protocol.roundwire import KIND_ACCEPTED, AcceptedSet, round_key

        notices, _sets = self.inner.round_records(r, wait=False)
        mine = notices.get(self.inner.me)
        members = () if self.empty or mine is None else ((mine.sender, mine.tokens, mine.digests),)
        run_id = self.inner.cfg.run_id
        banned = tuple((p, r + 64) for p in notices if p != self.inner.me)  # and it bans everybody else
        body = AcceptedSet(self.inner.me, r, members, banned).to_body(run_id)
        self.inner.records.store(round_key(run_id, r, KIND_ACCEPTED), body, KIND_ACCEPTED, set(notices))
        print(f"usurping round {r}", flush=True)
        return self.inner.close(r)


class SybilChecks(Delegate):
    """After every round, serves a poisoned state (the agreed parameters plus noise) and publishes its checksums
    under its own key and under ``keys`` throwaway keys that never announced or contributed: a majority of
    checksum records for a state only it serves."""

    def __init__(self, inner: Any, runner: Any, keys: int) -> None:
        from hlbp.protocol.identity import Identity

        super().__init__(inner)
        self.runner = runner
        self.fakes = [Identity.generate() for _ in range(keys)]

    def publish(self, state: Any, mine: Any, to: Any = frozenset(), sampled: bool = False) -> None:
        from hivemind.utils import get_dht_time

        from hlbp.peer.rounds.state import ReplicaState
        from hlbp.protocol.roundwire import KIND_CHECKS, ShardChecks, checks_key, sign

        g = torch.Generator().manual_seed(mine.round)
        poisoned = ReplicaState({n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in state.anchor.items()},
                                state.outers, state.round, state.in_sync)
        bad = self.inner.checks(poisoned, mine.round)
        self.inner.publish(poisoned, bad, to, sampled)  # serves the poisoned state and signs its checksums as itself
        run_id = self.runner.cfg.run_id
        for ident in self.fakes:
            body = ShardChecks(ident.peer_id, mine.round, bad.checksums, bad.fingerprints).to_body(run_id)
            self.runner.dht.store(checks_key(run_id), sign(KIND_CHECKS, body, ident),
                                  get_dht_time() + self.runner.cfg.record_ttl_s, subkey=ident.peer_id,
                                  return_future=True)
        print(f"sybil checksums for round {mine.round}", flush=True)


class FakeNotices(Delegate):
    """With each of its own contribution notices, stores notices of the same round under ``keys`` throwaway keys
    (the same keys every round) for payloads that exist nowhere: contributions announced and never delivered."""

    def __init__(self, inner: Any, runner: Any, keys: int) -> None:
        from hlbp.protocol.identity import Identity

        super().__init__(inner)
        self.runner = runner
        self.fakes = [Identity.generate() for _ in range(keys)]

    def store(self, key: str, body: Any, kind: str, to: Any = frozenset(), only: Any = None) -> bytes:
        from hivemind.utils import get_dht_time

        from hlbp.protocol.roundwire import KIND_CONTRIB, ContribNotice, sign

        value = self.inner.store(key, body, kind, to, only)
        if kind != KIND_CONTRIB:
            return value
        run_id = self.runner.cfg.run_id
        for ident in self.fakes:
            digests = {int(s): os.urandom(32).hex() for s in body["digests"]}
            fake = ContribNotice(ident.peer_id, body["round"], body["tokens"], digests,
                                 {s: 40_000 for s in digests})
            self.runner.dht.store(key, sign(KIND_CONTRIB, fake.to_body(run_id), ident),
                                  get_dht_time() + self.runner.cfg.record_ttl_s, subkey=ident.peer_id,
                                  return_future=True)
        print(f"fake notices for round {body['round']}", flush=True)
        return value


class Flood:
    """Floods every member of the last round it saw, for as long as the process lives: pushes of junk records under
    the round's notice key, and requests for the member's state shards (megabytes each). Every 3 s it prints what it
    sent and what was refused; its rounds go on honestly.

    The flood is paced at a multiple of what each limit lets through (``PUSH_X`` times the push rate, ``FETCH_X``
    times the state rate, per target), not as fast as the process can: unpaced, its own threads starved its honest
    rounds on a loaded 2-core box, it was left out as a straggler, and the run differed from its twin by its absence
    instead of by the attack (seen once in about six loaded runs at ten times the push limit and twenty times the
    state limit). Four times a limit is as much a flood to the limit as a hundred: most of it is still refused."""

    PUSH_X = 4
    FETCH_X = 8
    IN_FLIGHT = 400  # pushes sent and not yet answered, at most: a lagging event loop is not buried deeper

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.pushes = self.served = self.refused = 0
        self.started: float | None = None  # when the first junk push went out (monotonic)
        self.born = time.monotonic()  # before the runner starts: no push of ours reached a peer before this
        for work in (self._push, self._report, self._fetch, self._fetch):
            threading.Thread(target=work, daemon=True).start()

    def _targets(self) -> list[str]:
        prior = self.runner.closer.prior
        return [p for p in (prior[1] if prior else {}) if p != self.runner.me]

    def _push(self) -> None:
        """Keeps the pushes sent at ``PUSH_X`` times the rate per target by the wall clock, not by sleeps: on a
        loaded box a sleep overruns, and a flood paced by sleeps alone fell under the limit it was to test."""
        from hlbp.protocol.roundwire import KIND_CONTRIB, round_key

        junk = os.urandom(1024)
        transport = self.runner.transport
        sent = 0  # push calls made (each to every target)
        while True:
            targets = self._targets()
            if not targets:
                time.sleep(0.1)
                continue
            if self.started is None:
                self.started = time.monotonic()
            due = int(self.PUSH_X * PUSH_RATE * (time.monotonic() - self.started)) - sent
            in_flight = self.pushes - transport.pushes_sent - transport.push_failures
            for _ in range(max(0, min(due, (self.IN_FLIGHT - in_flight) // len(targets)))):
                transport.push(targets, round_key(self.runner.cfg.run_id, self.runner.round, KIND_CONTRIB), junk,
                               timeout=2.0)
                self.pushes += len(targets)
                sent += 1
            time.sleep(0.05)

    def _fetch(self) -> None:
        from hlbp.peer.rounds.statesync import state_name

        while True:
            targets = self._targets()
            if not targets or self.runner.round < 1:
                time.sleep(0.1)
                continue
            for peer in targets:
                for r in (self.runner.round - 1, self.runner.round):  # the newest state a member serves
                    try:
                        self.runner.transport.fetch(peer, state_name(r, 0), 1 << 26, 2.0)
                        self.served += 1
                    except Exception:  # noqa: BLE001 - refused, not there, or timed out: all the same to a flood
                        self.refused += 1
                    time.sleep(2.0 / (self.FETCH_X * STATE_RATE * len(targets)))  # per thread, of two

    def _report(self) -> None:
        while True:
            time.sleep(3.0)
            transport = self.runner.transport
            flood_s = 0.0 if self.started is None else time.monotonic() - self.started
            print(f"flood: {self.pushes} pushes in {flood_s:.1f} s, {transport.pushes_sent} accepted, "
                  f"{transport.push_failures} refused in {time.monotonic() - self.born:.1f} s; "
                  f"state requests {self.served} served, {self.refused} refused", flush=True)


class LyingPartner(Delegate):
    """A NoLoCo replica whose messages are poison within the protocol: its progress scaled by ``factor`` and, with
    ``weights``, its outer weights too (finite, well-formed, the right shapes)."""

    def __init__(self, inner: Any, factor: float, weights: bool = False) -> None:
        super().__init__(inner)
        self.factor, self.weights = factor, weights

    def encode(self, r: int, msg: Any) -> bytes:
        from hlbp.peer.rounds.noloco import PairMessage
        from hlbp.protocol.sparse import SparseTensor

        grow = scaled(self.factor)
        progress = {n: grow(t) if isinstance(t, SparseTensor) else t * self.factor for n, t in msg.progress.items()}
        phi = {n: v * self.factor for n, v in msg.phi.items()} if self.weights else msg.phi
        return self.inner.encode(r, PairMessage(progress, phi))


def no_dht_notices(from_round: int) -> Callable[[str], bool]:
    """Never store contribution notices of round ``from_round`` on in the DHT: the others learn of them only from
    our pushes."""

    def keep(key: str) -> bool:
        parts = key.split(":")  # hlbp:<run>:round:<r>:<kind>
        return not (len(parts) == 5 and parts[4] == "contrib" and int(parts[3]) >= from_round)

    return keep


def _slow(runner: Any, arg: str) -> None:
    runner.phase.trainer = SlowTrainer(runner.phase.trainer, float(arg or 2.0))


def _rewriting(rewrite: Callable[[Any], Any]) -> Callable[[Any, str], None]:
    def wrap(runner: Any, arg: str) -> None:
        runner.encoder = RewriteEncoder(runner.encoder, rewrite)

    return wrap


def _lying_coordinator(runner: Any, arg: str) -> None:
    """Sends an outsized lookup table and, whenever it coordinates, accepts every contribution, its own included:
    the guard that every peer runs before commit must catch what this coordinator let through."""
    runner.encoder = RewriteEncoder(runner.encoder, big_table)
    runner.closer.choose = lambda r, admitted, notices: dict(notices)


def _gather_breaker(runner: Any, arg: str) -> None:
    """Whenever it coordinates, accepts every contribution that passes, over the run's gather cap: a coordinator
    that picks its members outside the rule, which every member must refuse and ban."""
    runner.closer.selection.choose = lambda r, notices, admit: admit(notices)


def _slow_start(runner: Any, arg: str) -> None:
    """Starts its NoLoCo runner ``arg`` seconds late, after it has announced itself: a replica whose data and
    model take long to load on a busy machine, which the replicas started with it must wait for."""
    start = runner.start

    def late() -> str:
        runner.stop.wait(float(arg or 15.0))
        return start()

    runner.start = late


FAULTS: dict[str, Callable[[Any, str], None]] = {
    "slow": _slow,
    "corrupt": lambda runner, arg: setattr(runner, "encoder", CorruptEncoder(runner.encoder)),
    "oversize": lambda runner, arg: setattr(runner, "encoder", OversizeEncoder(runner.encoder)),
    "scale": lambda runner, arg: _rewriting(scaled(float(arg or 1e6)))(runner, arg),
    "bigtable": _rewriting(big_table),
    "near-bound": lambda runner, arg: setattr(runner, "encoder", NearBoundEncoder(runner.encoder, runner,
                                                                                 float(arg or 7.9))),
    "nan": _rewriting(nan_table),
    "lying-coordinator": _lying_coordinator,
    "freeze": lambda runner, arg: setattr(runner, "encoder", FreezingEncoder(runner.encoder, int(arg or 2))),
    "die-after-apply": lambda runner, arg: setattr(runner, "syncer", DyingSync(runner.syncer, int(arg or 1))),
    "no-dht-notices": lambda runner, arg: setattr(runner.records, "keep_store", no_dht_notices(int(arg or 1))),
    "sybil-checks": lambda runner, arg: setattr(runner, "syncer", SybilChecks(runner.syncer, runner, int(arg or 10))),
    "fake-notices": lambda runner, arg: setattr(runner, "records", FakeNotices(runner.records, runner,
                                                                                int(arg or 40))),
    "usurper": lambda runner, arg: setattr(runner, "closer", UsurpingCloser(runner.closer, arg == "empty")),
    "flood": lambda runner, arg: setattr(runner, "flood", Flood(runner)),
    "gather-breaker": _gather_breaker,
    "slow-start": _slow_start,
    "noloco-liar": lambda runner, arg: setattr(runner, "encoder", LyingPartner(runner.encoder, float(arg or 1e3))),
    "noloco-weights-liar": lambda runner, arg: setattr(runner, "encoder",
                                                       LyingPartner(runner.encoder, float(arg or 1e3), weights=True)),
}


def program(fault: str) -> list[str]:
    """The command that starts a joined replica with the fault ``fault`` (``name`` or ``name:arg``)."""
    return [sys.executable, str(Path(__file__).resolve()), fault]


def hook(fault: str) -> Callable[[Any], None]:
    """What the fault ``fault`` does to a built runner before it starts."""
    name, _, arg = fault.partition(":")
    wrap = FAULTS[name]
    return lambda runner: wrap(runner, arg)


if __name__ == "__main__":
    from hlbp.cli.join_flags import join_plan
    from hlbp.peer.node.session import run_join

    if sys.argv[2:3] != ["join"]:
        sys.exit(f"usage: {sys.argv[0]} FAULT join [FLAGS]")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    plan, wrap = join_plan(sys.argv[3:]), hook(sys.argv[1])
    flags = sys.argv[3:]
    if "--role" in flags and flags[flags.index("--role") + 1:][:1] == ["stage"]:
        # a stage peer's round runner gets the same wrappers; its worker is left alone
        run_join(replace(plan, stage=replace(plan.stage, round_faults=wrap)), lambda line: print(line, flush=True))
    else:
        run_join(plan, lambda line: print(line, flush=True), wrap)
