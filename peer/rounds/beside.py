"""A stage peer's rounds with each round's verification beside its next inner phase.

A stage peer does not overlap its phase with the round's exchange as a full replica does: its next phase starts
from the round's result, which its neighbours' frames and the audits of them assume (docs/design.md, pipeline
audits). It need not wait for the verification, though. Once the round's result is applied, loaded into the stage
and our checksums published (:meth:`~hlbp.peer.rounds.sparseloco.RoundRunner.settle`), the next phase can start
from it, while the comparison with the other members' checksums
(:meth:`~hlbp.peer.rounds.sparseloco.RoundRunner.confirm`) runs in a worker thread. That comparison mostly waits:
for the full replicas, which apply the whole model, to publish theirs.

If it finds us out of sync (our result differs from the members' majority although we applied the same accepted
set), the worker reloads the state but not the model, which the phase under way owns (``overlapping``). That
phase started from parameters nobody else holds: the round after it sits out, without a contribution, and the
round's result replaces the model as usual. Its frames came from our wrong state, and an audit at the agreed one
would find them wrong and convict us: so the worker takes the phase's work back at once, through the round loop's
``taint`` (:meth:`~hlbp.peer.rounds.sparseloco.Taint.withdraw_phase`: the stage's transcript index then says so, and
the auditor leaves our work and our chain's out of the round without a ban). The swarm's work of that round is
what this loop gives up against waiting for the verdict every round.

A resync that is over before the next phase starts is different: the state then names a later round (a peer that
fell behind takes the members' newest state) while the model still holds the parameters it replaced. A phase
trained from those under the new round's labels sends frames an audit at that round's anchor convicts as lies
(an honest driver that resynced from round 4 to 19 was banned so, and its stage partner's work left out for
every later round). So the next phase first joins a verification that is over or that moved the state's round,
and starts from the state it loaded.

A round is reported by the worker as soon as its verdict is in, with the validation loss scored right after the
result was loaded, before the next phase trained it; :meth:`BesideLoop.run_round` returns it one call late, and
:meth:`BesideLoop.finish` the last one when the peer stops.
Only stage peers whose codec's table is fixed use this loop (not B or A+drift, whose table follows the embedding:
a resync after the verification, or a follower's fetch of shard 0, would change it under a phase).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from hlbp.peer.rounds.config import RoundStats
from hlbp.peer.rounds.outer import Contribution
from hlbp.peer.rounds.report import Scored
from hlbp.peer.rounds.state import ReplicaState
from hlbp.protocol.roundwire import ShardChecks

logger = logging.getLogger(__name__)


class SettlingLoop(Protocol):
    """What :class:`BesideLoop` needs of the round loop it runs (a
    :class:`hlbp.peer.rounds.sparseloco.RoundRunner`)."""

    state: ReplicaState
    stop: Any
    taint: Any
    overlapping: bool
    reporter: Any  # a RoundReporter: it scores the round's result right after the settle

    def begin_round(self, r: int) -> tuple[RoundStats, int, int, int]: ...

    def contribute(self, r: int, stats: RoundStats, steps: int, tokens: int,
                   base: Mapping[str, Any]) -> dict[int, Contribution]: ...

    def settle(self, r: int, stats: RoundStats, mine: dict[int, Contribution],
               start: Mapping[str, Any] | None = None) -> Any: ...

    def confirm(self, r: int, stats: RoundStats, settled: Any) -> ShardChecks: ...

    def bytes_served(self) -> int: ...

    def report(self, stats: RoundStats, mine: ShardChecks, steps: int, params: Mapping[str, Any] | None = None,
               scored: Scored | None = None) -> RoundStats: ...

    def load_anchor_into_model(self) -> None: ...

    def save_if_due(self) -> None: ...


@dataclass
class _Confirming:
    """A settled round whose verification, and then report, run in the background."""

    stats: RoundStats
    future: Future  # the round's report (None: abandoned on SIGTERM, not reported)


class BesideLoop:
    """The rounds of a stage peer's :class:`~hlbp.peer.rounds.sparseloco.RoundRunner` (``runner``) with each
    verification beside the next phase (see the module docstring). It stands where an
    :class:`~hlbp.peer.rounds.overlap_loop.OverlapLoop` would: a phase always starts from the anchor (``base``
    None) and nothing lands mid-phase."""

    base = None

    def __init__(self, runner: SettlingLoop) -> None:
        self.runner = runner
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hlbp-confirm")
        self.inflight: _Confirming | None = None
        self.stale = False  # a resync replaced the state the phase under way started from
        self.next_round: int | None = None  # the round the last settle left the state at (None: none yet)

    def preview(self, r: int, final: bool = False) -> None:
        """Nothing lands mid-phase here."""

    def land(self) -> None:
        """Nothing lands mid-phase here."""

    def _confirm(self, r: int, stats: RoundStats, settled: Any, steps: int, served_before: int, comm_s: float,
                 closed: bool, scored: Future, phase: int) -> RoundStats | None:
        """The worker thread: verify round ``r`` and report it at once (not at the next phase's end: a peer
        whose run has stopped sending rounds would otherwise hold its last report for a whole phase). ``phase``:
        the round of the phase that starts from round r's result, whose work a resync takes back if it is under
        way."""
        run = self.runner
        checks = run.confirm(r, stats, settled)
        if stats.synced and run.taint is not None:
            run.taint.withdraw_phase(phase)  # before the round's audits, where it can: the phase's frames are wrong
        stats.comm_s = comm_s  # the verification's seconds ran beside the phase: stats.phases["verify"]
        stats.bytes_sent = run.bytes_served() - served_before
        if not closed and run.stop.is_set():
            return None  # abandoned on SIGTERM: not a round to report
        # a resync replaced the parameters the loss was scored on: the report then carries none
        loss = scored.result()
        return run.report(stats, checks, steps, scored=Scored(None) if stats.synced else loss)

    def _join(self) -> RoundStats | None:
        """Wait for the verification in flight and its report (None: nothing in flight, or a round abandoned on
        SIGTERM); the next phase may then own the model again."""
        f, self.inflight = self.inflight, None
        if f is None:
            return None
        try:
            return f.future.result()
        finally:
            self.runner.overlapping = False
            if f.stats.synced:
                self.stale = True

    def run_round(self) -> RoundStats | None:
        """Train phase ``runner.state.round`` (the last round's verification runs beside it), contribute and settle
        its round, and leave that round's verification and report to the background; returns the round reported
        meanwhile (None on the first call, or for a round abandoned on SIGTERM)."""
        run = self.runner
        r = run.state.round
        early = None
        f = self.inflight
        if f is not None and (f.future.done() or r != self.next_round):
            # the verification is over, or it resynced the state to another round: the phase starts from what
            # it loaded, not from the parameters it replaced (see the module docstring)
            early = self._join()
            if self.stale:
                self.stale = False
                run.load_anchor_into_model()
            r = run.state.round
        if run.taint is not None:
            run.taint.phase_started(r)
        stats, steps, tokens, served_before = run.begin_round(r)
        finished = early if early is not None else self._join()
        if self.stale:
            # phase r trained from parameters a resync has since replaced: its steps are not a pseudo-gradient of
            # anything the others hold, so it sits this round out, as a freshly synced peer does
            logger.info("round %d: discarding the inner phase trained before the resync", r)
            steps = tokens = 0
            self.stale = False
            if run.taint is not None:
                run.taint.withdraw_phase(r)  # the worker did, unless its resync ended just before the phase began
        if finished is not None:
            run.save_if_due()  # the state is verified (or resynced) now
        start = run.state.anchor.snapshot() if run.taint is not None else None
        t1 = time.perf_counter()
        mine = run.contribute(r, stats, steps, tokens, run.state.anchor)
        encode_s = time.perf_counter() - t1
        settled = run.settle(r, stats, mine, start)
        stats.phases = {"encode": encode_s, **stats.phases}
        comm_s = encode_s + time.perf_counter() - settled.started
        closed = settled.accepted is not None
        if closed or not run.stop.is_set():
            run.state.round = r + 1  # a round abandoned on SIGTERM is not ours to count: a restart syncs past it
        self.next_round = run.state.round
        run.overlapping = True  # from here the verification must not touch the model: the next phase trains it
        scored: Future = Future()
        future = self.pool.submit(self._confirm, r, stats, settled, steps, served_before, comm_s, closed, scored,
                                  self.next_round)
        self.inflight = _Confirming(stats, future)
        try:  # right after the settle, while the model holds the result, before the next phase trains it
            scored.set_result(Scored(run.reporter.score(run.state.anchor) if closed else None))
        except BaseException as exc:
            scored.set_exception(exc)
            raise
        return finished

    def finish(self) -> RoundStats | None:
        """Join the verification in flight (at stop or after the last round) and return its report; the model then
        holds the agreed state."""
        finished = self._join()
        self.pool.shutdown(wait=True)
        if self.stale:
            self.stale = False
            self.runner.load_anchor_into_model()
        return finished

    def quiesce(self) -> None:
        """Wait for the verification in flight, if any, ignoring its outcome (the run is ending on an error)."""
        f, self.inflight = self.inflight, None
        if f is not None:
            f.future.exception()
        self.runner.overlapping = False
