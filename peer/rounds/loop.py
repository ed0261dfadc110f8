"""The part of a full replica's round loop that does not depend on how pseudo-gradients are exchanged.

:class:`hlbp.peer.rounds.sparseloco.RoundRunner` (SparseLoCo payloads with an accepted set) and
:class:`hlbp.peer.rounds.diloco.DenseRoundRunner` (hivemind's all-reduce) both build on :class:`ReplicaBase`:

- the anchor θ(r) (the parameters every in-sync replica agrees on) and one outer optimizer per shard;
- the inner phase (H steps, cut short when the round closes without us);
- signed DHT records, registered with our own DHT node's validator;
- the published state after every round (checksums, served shard blobs) and the agreement check against it;
- state sync from agreeing donors, checkpoints (atomic, resumed if current) and the per-round report.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from hlbp.peer.common import memory
from hlbp.peer.net.transport import BlobTransport
from hlbp.peer.rounds.agreement import Agreement, ExactAgreement
from hlbp.peer.rounds.anchor import Anchor
from hlbp.peer.rounds.config import RoundConfig, RoundStats
from hlbp.peer.rounds.outer import OuterConfig, make_outer
from hlbp.peer.rounds.persist import Checkpoints
from hlbp.peer.rounds.phase import InnerPhase
from hlbp.peer.rounds.records import RoundRecords
from hlbp.peer.rounds.report import RoundReporter, Scored
from hlbp.peer.rounds.rules import Expected
from hlbp.peer.rounds.state import ReplicaState, Start, StartKind
from hlbp.peer.rounds.verify import StateSync
from hlbp.peer.train.metricslog import MetricsLog
from hlbp.peer.train.trainer import InnerTrainer
from hlbp.protocol.identity import Identity
from hlbp.protocol.roundwire import (
    ShardChecks,
)

__all__ = ["ReplicaBase", "RoundConfig", "RoundStats"]  # the config and stats live in rounds/config.py

logger = logging.getLogger(__name__)



# a starting peer behind a newer agreed state (resumed from an older checkpoint, or with none) retries its sync this
# often, this far apart: the state's holders may be restarting beside it (a whole swarm stopped and started again)
# and serve it once they are up, or the newest round's checksums may still be arriving; starting from the seed's
# weights instead would only leave it out of sync
RESUME_SYNC_ATTEMPTS = 8
RESUME_SYNC_PAUSE_S = 3.0

class ReplicaBase(ABC):
    """What every round loop shares: the anchor, outer optimizers, inner phase, DHT records, checkpoints, agreement
    checks and state sync. Subclasses implement ``run_round``.

    ``shards``: parameter names per shard (the manifest's partition). ``held``: the shards this peer contributes
    and checks, all for a full replica; a stage peer holds one, its model has only that shard, and it passes
    ``shapes`` (every shard's) to decode others' contributions. ``expected``: the contributors to wait for
    (:class:`~hlbp.peer.rounds.rules.Expected`).
    ``train(r)``: an inner phase whose steps run elsewhere (a stage peer's swarm), in place of the trainer's;
    ``on_load(anchor)``: called after each load of the anchor into the model (a stage rebuilds its codec's table).
    ``sit_out``: whether the first round after a state sync is sat out when others already announce it
    (:meth:`~hlbp.peer.rounds.phase.InnerPhase.run`); False for a phase whose steps another peer drives.
    """

    agreement: Agreement = ExactAgreement()  # how the replicas tell the agreed state after a round

    def __init__(
        self,
        dht: Any,
        identity: Identity,
        transport: BlobTransport,
        trainer: InnerTrainer,
        outer: OuterConfig,
        shards: Sequence[Sequence[str]],
        cfg: RoundConfig,
        stop: threading.Event,
        checkpoint: Path | None = None,
        metrics: MetricsLog | None = None,
        expected: Callable[[], Expected] | None = None,
        on_round: Callable[[RoundStats, float | None], None] | None = None,
        evaluate: Callable[[Mapping[str, torch.Tensor]], float | None] | None = None,
        guard_loss: Callable[[int, Mapping[str, torch.Tensor]], float | None] | None = None,
        protect: Callable[[dict[str, tuple[str, int]]], None] | None = None,
        held: Sequence[int] | None = None,
        shapes: Sequence[dict[str, tuple[int, ...]]] | None = None,
        train: Callable[[int], tuple[int, int]] | None = None,
        on_load: Callable[[Mapping[str, torch.Tensor]], None] | None = None,
        sit_out: bool = True,
    ) -> None:
        self.dht, self.identity, self.transport, self.trainer = dht, identity, transport, trainer
        self.me = identity.peer_id
        self.outer_cfg, self.cfg, self.stop = outer, cfg, stop
        self.shards = [list(s) for s in shards]
        self.held = sorted(set(held)) if held is not None else list(range(len(self.shards)))
        if not self.held or not set(self.held) <= set(range(len(self.shards))):
            raise ValueError(f"held shards {held} are not shards of a {len(self.shards)}-shard partition")
        self.shapes = [dict(x) for x in shapes] if shapes is not None else \
            [{n: tuple(self._param(n).shape) for n in s} for s in self.shards]
        self.state = ReplicaState(  # the anchor filled one parameter at a time (on disk, one is in memory at once)
            anchor=Anchor(((n, p.detach().float().cpu().clone()) for n, p in trainer.model.named_parameters()),
                          spill_dir=cfg.state_dir),
            outers={s: make_outer(outer) for s in self.held})
        memory.trim()  # a model built on the host and moved to its device left its host copy freed, not returned
        self.checkpoints = Checkpoints(checkpoint, cfg.checkpoint_every_s, trainer, cfg.run_id)
        self.reporter = RoundReporter(metrics or MetricsLog(None), evaluate, on_round,
                                      trained=sum(p.numel() for p in trainer.model.parameters()))
        self.expected = expected
        self.on_load = on_load  # called after every load of the anchor into the model (a stage's codec table)
        # (r, params): the loss on the run's fixed guard batch of round r's anchor or candidate result (rounds/guard.py);
        # None from it: not known this round
        self.guard_loss = guard_loss
        self.window = cfg.deadline_s
        self.last_members = 0
        self.history: list[RoundStats] = []
        self._bytes_in = 0
        self._traffic = (0, 0)  # round records (received, sent) as of the last report
        self.overlapping = False  # an exchange runs beside the inner phase: only the main thread loads the model
        # signed round records: the inbox of pushed ones, the DHT pollers, whom we push ours to (rounds/records.py)
        self.records = RoundRecords(dht, identity, transport, cfg, stop, lambda: self.state.round, protect)
        self.phase = InnerPhase(trainer, cfg, stop, self.round_closed, self.round_started, self.phase_base,
                                self._after_step, train, sit_out, self.holding_up)
        self.syncer = StateSync(self.me, self.shards, self.held, self.shapes, cfg, outer, transport, self.records,
                                self.agreement, member_votes=self.agreement.member_votes)

    @property
    def round(self) -> int:
        """The next round to run (read-only: the round loop owns :attr:`state`)."""
        return self.state.round

    @property
    def in_sync(self) -> bool:
        """Whether our state is the agreed one (read-only, as :attr:`round`)."""
        return self.state.in_sync


    def _param(self, name: str) -> torch.nn.Parameter:
        return dict(self.trainer.model.named_parameters())[name]

    # -- state -----------------------------------------------------------------------------------------------

    def load_anchor_into_model(self) -> None:
        if self.overlapping:
            return  # the model is the main thread's, training the next phase (see rounds/overlap_loop.py)
        self.trainer.load_params(self.state.anchor)  # a variant-A trainer's constraint then projects from these
        if self.on_load is not None:
            self.on_load(self.state.anchor)

    def phase_base(self) -> Mapping[str, torch.Tensor]:
        """Where the inner phase under way started: the anchor, or its overlapped start (rounds/overlap.py)."""
        return self.state.anchor

    def sync(self, attempts: int = 3, pause_s: float = 0.0) -> bool:
        """Load the newest agreed state from peers (:meth:`StateSync.sync`, ``pause_s`` between attempts); False
        if there is none yet (a fresh run) or every bounded attempt failed."""
        received = self.syncer.sync(self.state, attempts, pause_s, self.stop)
        if received is None:
            return False
        self._bytes_in += received
        self.load_anchor_into_model()
        self.phase.just_synced = True
        return True

    def save_if_due(self) -> None:
        """Save when ``checkpoint_every_s`` has passed; exits always save."""
        self.checkpoints.save_if_due(self.state)

    def save(self) -> None:
        """Save the checkpoint now (never a non-finite state: :mod:`hlbp.peer.rounds.persist`)."""
        self.checkpoints.save(self.state)

    def start(self) -> Start:
        """Resume, sync or start fresh; returns which (its text is the log's)."""
        resumed = self.checkpoints.resume(self.state)
        self.records.protect(self.state.round)
        if resumed and self.state.round > 0 and self.state.in_sync:
            # serve the state we come back with at once, with the records that show who the members of its round
            # were: peers restarting beside us from older checkpoints sync from it (waiting for our first round to
            # serve it split a restarted swarm for two rounds)
            self.records.protect(self.state.round - 1)
            self.records.restore(self.state.evidence)
            self.syncer.publish(self.state, self.syncer.checks(self.state, self.state.round - 1))
            # a swarm restarted together publishes as each peer comes up: deciding before the other members of our
            # checkpoint's round did would sync a newer checkpoint back a round, or leave an older one behind
            self.syncer.await_members(self.state.round - 1, self.stop, RESUME_SYNC_ATTEMPTS, RESUME_SYNC_PAUSE_S)
            # our checkpoint may hold a round whose accepted set never reached the others (we stopped as we closed
            # it): while they are still closing that round, resuming ours would run the next rounds alone
            self.syncer.await_closing(self.state.round, self.stop, RESUME_SYNC_PAUSE_S)
        # the round after the newest agreed state (or after our checkpoint's) may have closed just before the others
        # stopped: its members come back holding its result, and publish it as they resume. Deciding before they
        # did resumed the peers a round apart (one had applied that round before its stop, another not)
        found = self.syncer.agreed_round()
        after = max(found[0] + 1 if found is not None else 0, self.state.round if resumed else 0)
        self.syncer.await_result(after, self.stop, RESUME_SYNC_ATTEMPTS, RESUME_SYNC_PAUSE_S)
        current = self.syncer.current(self.state) if self.state.in_sync else False  # saved out of sync: it syncs
        if current is None:
            return Start(StartKind.RESUMED if resumed else StartKind.FRESH)
        if resumed and current:
            self.load_anchor_into_model()
            return Start(StartKind.CURRENT)
        # joining a run under way: its first trained phase must end soon after the others' (it catches up), and a
        # process's first pass is slower than the rest (tiny model, fresh process: 0.14 s against 0.07 s), so
        # take it now, off that phase
        self.trainer.warm_up()
        # a newer agreed state exists; its holders may be restarting too, and serve it once they are up: retry
        if self.sync(RESUME_SYNC_ATTEMPTS, RESUME_SYNC_PAUSE_S):
            return Start(StartKind.SYNCED, self.state.round - 1)
        return Start(StartKind.FRESH_UNAGREED)

    # -- one round ---------------------------------------------------------------------------------------------

    def run(self, max_rounds: int | None = None) -> list[RoundStats]:
        """Run rounds until stopped or ``max_rounds`` were contributed to; returns their reports. Under overlap a
        report comes one call late, and :meth:`finish_rounds` reports the exchange still in flight at the end."""
        calls = 0
        try:
            while not self.stop.is_set() and (max_rounds is None or calls < max_rounds):
                stats = self.run_round()
                calls += 1
                if stats is not None:
                    self.history.append(stats)
            last = self.finish_rounds()
            if last is not None:
                self.history.append(last)
        finally:
            self.quiesce_rounds()  # no exchange may still write the anchor while it is saved
            self.save()  # also when the round loop fails (a dead DHT process): the progress so far is kept
        return self.history

    @abstractmethod
    def run_round(self) -> RoundStats | None:
        """Run round ``self.state.round`` (or abandon it on stop) and return the report of the round that finished, if
        any: without overlap that round itself."""

    def finish_rounds(self) -> RoundStats | None:
        """Finish the exchange still under way at the end of the run (none without overlap) and report it."""
        return None

    def quiesce_rounds(self) -> None:
        """Wait for any exchange still under way, whatever its outcome (none without overlap)."""

    def report(self, stats: RoundStats, mine: ShardChecks, steps: int,
               params: Mapping[str, torch.Tensor] | None = None, scored: Scored | None = None) -> RoundStats:
        """Score the new parameters (``params``: a snapshot of them, else the anchor; ``scored``: scored already),
        write the round's metrics record and tell the caller (:class:`RoundReporter`). The round records counted
        since the last report are this round's (under overlap: the period it was reported in)."""
        received, sent = self.records.traffic()
        stats.records_received, stats.records_sent = received - self._traffic[0], sent - self._traffic[1]
        self._traffic = (received, sent)
        return self.reporter.report(stats, mine, steps, params if params is not None else self.state.anchor, scored)

    def close(self) -> None:
        """Release what the runner started (the dense runner's averager); the transport is the caller's."""

    def begin_round(self, r: int) -> tuple[RoundStats, int, int, int]:
        """Protect round r's keys, reset the byte counters and run the inner phase: (stats, steps, tokens, bytes
        served so far)."""
        self.records.protect(r)
        self.records.inbox.prune()  # records of rounds long past
        self.records.poller.forget(self.records.wants)
        self.records.phase_poller.forget(self.records.wants)
        stats = RoundStats(round=r)
        served_before = self.bytes_served()
        if not self.overlapping:
            self._bytes_in = 0  # under overlap the exchange in flight still counts; it takes a difference instead
        turns = self.trainer.turns
        waited = turns.step_wait_s if turns is not None else 0.0
        t0 = time.perf_counter()
        steps, tokens = self.phase.run(r)
        stats.turn_wait_s = turns.step_wait_s - waited if turns is not None else 0.0
        stats.compute_s = time.perf_counter() - t0 - stats.turn_wait_s
        return stats, steps, tokens, served_before

    def _after_step(self, r: int, step: int) -> None:
        """After each inner step, on the main thread (an overlapped exchange lands its result here)."""

    @abstractmethod
    def round_closed(self, r: int, wait: bool = True) -> bool:
        """Whether round r has already closed without us (the inner phase then stops early). ``wait``: look it
        up now; else answer from ``phase_poller``'s last read and the records pushed to us."""

    def round_started(self, r: int, wait: bool = True) -> bool:
        """Whether other replicas have already finished their inner phase of round r (none can tell: False);
        ``wait`` as for :meth:`round_closed`."""
        return False

    def holding_up(self, r: int) -> bool:
        """Whether the others wait for our close of round r while our inner phase runs (none can tell: False);
        answered without waiting."""
        return False

    def bytes_served(self) -> int:
        return self.transport.bytes_served
