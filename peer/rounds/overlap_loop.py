"""Running a replica's rounds with each exchange in the background, during the next inner phase (issue 16).

Without overlap a round is: inner phase, contribute, exchange (close, apply, verify), and the next phase starts from
the new anchor. Here the exchange of round r runs in a worker thread while the main thread already trains phase
r+1, which starts from :func:`hlbp.peer.rounds.overlap.phase_start` (the anchor one round late, moved by our own
round-r contribution under ``eager``). The main thread never waits for the network except when phase r+1 ends
before round r's exchange: that wait is the round's ``wait_s``, and ``comm_s`` is only the encoding and announcing
of our contribution, so ``compute / (compute + comm + wait)`` is the share of time compute was busy.

What each thread may touch. The exchange thread owns the anchor, the outer optimizers' apply side and the round
records of round r; it must not touch the model, which the main thread trains: the runner's
``load_anchor_into_model`` is a no-op while a phase runs, evaluation and the loss guard score parameters on a
separate scorer, and a resync during the exchange only marks the phase under way as stale. The main thread joins
the exchange before it contributes the next round, saves a checkpoint or reports, so the error-feedback buffer, the
anchor and the checkpoint are never read half-updated.

Reports come one round late: the call that trains phase r+1 returns round r's report. The first call returns None
(nothing has finished yet), and :meth:`OverlapLoop.finish` reports the last exchange when the peer stops.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from hlbp.peer.rounds.config import RoundConfig, RoundStats
from hlbp.peer.rounds.outer import Contribution, OuterConfig
from hlbp.peer.rounds.overlap import Previewed, landing_shift, phase_start
from hlbp.peer.rounds.state import ReplicaState
from hlbp.protocol.roundwire import ShardChecks

logger = logging.getLogger(__name__)


class OverlappableLoop(Protocol):
    """What :class:`OverlapLoop` needs of the round loop it runs (a
    :class:`hlbp.peer.rounds.sparseloco.RoundRunner`): its state, its parts and the steps of a round."""

    cfg: RoundConfig
    outer_cfg: OuterConfig
    me: str
    shards: list[list[str]]
    state: ReplicaState
    trainer: Any
    payloads: Any
    stop: Any
    last_members: int
    overlapping: bool

    def begin_round(self, r: int) -> tuple[RoundStats, int, int, int]: ...

    def contribute(self, r: int, stats: RoundStats, steps: int, tokens: int,
                   base: Mapping[str, Any]) -> dict[int, Contribution]: ...

    def exchange(self, r: int, stats: RoundStats, mine: dict[int, Contribution]) -> tuple[ShardChecks, bool]: ...

    def bytes_served(self) -> int: ...

    def report(self, stats: RoundStats, mine: ShardChecks, steps: int,
               params: Mapping[str, Any] | None = None) -> RoundStats: ...

    def load_anchor_into_model(self) -> None: ...

    def save_if_due(self) -> None: ...



@dataclass
class _InFlight:
    """A round whose exchange runs in the background."""

    round: int
    stats: RoundStats
    steps: int
    served_before: int
    future: Future
    main_comm_s: float = 0.0  # the main thread's part: encoding and announcing our contribution
    step0: int = 0  # the trainer's step count when the next phase started (for landed_after)
    mine: dict[int, Contribution] = field(default_factory=dict)  # our contribution per shard (for previews)
    previewed: frozenset[str] = frozenset()  # the other senders in the last preview offered (exchange thread)
    previews: list[int] = field(default_factory=list)  # steps before each preview landed (main thread)
    landed: int | None = None  # steps before the round's result landed (main thread)


class OverlapLoop:
    """The overlapped round loop of a :class:`hlbp.peer.rounds.sparseloco.RoundRunner` (``runner``)."""

    def __init__(self, runner: OverlappableLoop) -> None:
        self.runner = runner
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hlbp-exchange")
        self.inflight: _InFlight | None = None
        self.base: Mapping[str, Any] | None = None  # where the phase under way started (None: the anchor)
        self.stale = False  # a resync replaced the anchor while the phase under way trained from the old one
        self._landed: RoundStats | None = None  # an exchange joined mid-phase by land(), not yet reported
        self._lock = threading.Lock()
        self._offer: tuple[int, Mapping[str, Any], bool] | None = None  # (round, parameters, final) to land next

    def _expected(self) -> int:
        """R for the eager proxy's 1/R weight: the members of the last closed round. Not a read of the live
        announcements: that is a DHT round trip, and this runs on the main thread between two inner phases."""
        return max(1, self.runner.last_members or 1)

    def _join(self) -> RoundStats | None:
        """Wait for the exchange in flight; its finished stats, with the main thread's comm and wait seconds (None:
        nothing in flight, or a round abandoned on SIGTERM)."""
        f = self.inflight
        if f is None:
            return None
        t0 = time.perf_counter()
        checks, closed = f.future.result()
        waited = time.perf_counter() - t0
        self.inflight = None
        stats = f.stats
        # the exchange thread's own seconds stay in stats.phases; what compute paid is the main thread's share
        stats.phases["exchange"] = stats.comm_s + stats.wait_s
        stats.comm_s, stats.wait_s = f.main_comm_s, waited
        stats.bytes_sent = self.runner.bytes_served() - f.served_before
        if stats.synced:
            self.stale = True  # the phase under way started from parameters we no longer hold
        if not closed and self.runner.stop.is_set():
            # abandoned on SIGTERM: not a round to report, and not one our state holds. The main thread counted it
            # at the handover; a checkpoint must name the round its anchor is the result of, or a restart resumes
            # a round ahead of its own parameters (and of the peers that stopped a round earlier)
            if not stats.synced and self.runner.state.round == f.round + 1:
                self.runner.state.round = f.round
            return None
        self._last = (stats, checks, f.steps)
        return stats

    def preview(self, r: int, final: bool = False) -> None:
        """On the exchange thread of round ``r``, under ``eager``: offer the phase under way a better start than
        eager's proxy, for :meth:`land` to move onto between two inner steps.

        While the round is open (``final`` False), the start offered is round r's result as far as it is known:
        the late global parameters advanced by our own contribution and those of the other senders whose payloads
        we already fetched and checked (prefetch), aggregated as the round will aggregate them. Only for SparseLoCo
        with the mean over selectors, whose result over a subset is an estimate of the result over the set. Each
        new sender makes a new offer, so a peer that announced early takes in the others' progress as it arrives
        instead of all at once when the slowest has announced and the round has closed.

        ``final``: the round is applied (or refused, or closed without us); the offer is the new global parameters,
        before they are verified. Were they to fail verification, the resync marks the phase stale, and its steps
        are discarded at its end as before. None of this touches the global parameters or what anyone sends.

        A hostile sender: a preview takes only payloads that matched their signed digest, decoded and passed the
        contribution norm bound (``Payloads.check``), from senders not banned. One the round later refuses (the
        update or loss guard) moves our private start for a few steps at most: the final landing replaces that
        start by the real result, and only the steps trained meanwhile keep its bounded influence. Previews are
        one per new sender, so at most ``prefetch_up_to`` aggregations a round."""
        run, f = self.runner, self.inflight
        if run.cfg.overlap != "eager" or f is None or f.round != r or not f.mine:
            return
        if final:
            params = run.state.anchor.snapshot()  # this version, read back after later rounds replace it
        else:
            if run.outer_cfg.kind != "sparseloco" or run.outer_cfg.aggregation != "selectors":
                return
            got: dict[str, dict[int, Contribution]] = {}
            for sender, s, c in run.payloads.checked(r):
                if s in f.mine and sender != run.me:
                    got.setdefault(sender, {})[s] = c
            senders = frozenset(p for p, cs in got.items() if cs.keys() >= f.mine.keys())
            if not senders or senders == f.previewed:
                return
            f.previewed = senders
            params = Previewed(run.state.anchor.snapshot(), [(run.state.outers[s], [own, *(got[p][s] for p in sorted(senders))],
                                                    run.shards[s]) for s, own in f.mine.items()])
        with self._lock:
            self._offer = (r, params, final)

    def land(self) -> None:
        """Between two inner steps, under ``eager``: move the phase under way onto the newest start
        :meth:`preview` offered, and, once the exchange in flight has finished, join it (landing its result now if
        no final offer did).

        Each move is by ``new start - current start`` (:func:`landing_shift`): the inner progress so far is kept,
        the start (at first eager's proxy, our own contribution's expected share) is swapped for a better estimate
        of the round's result and finally for the result itself, and the phase's pseudo-gradient is then taken
        against the new global parameters. So only the steps trained before the result arrived ran one round
        late. A resync is not landed: that phase is discarded at its end, as before. Naive delay does not land: it
        stays the paper's one-round baseline."""
        f = self.inflight
        run = self.runner
        if f is None or run.cfg.overlap != "eager":
            return
        with self._lock:
            offer, self._offer = self._offer, None
        if offer is not None and offer[0] == f.round and f.landed is None and not self.stale \
                and self.base is not None:
            _, params, final = offer
            run.trainer.shift_params(landing_shift(self.base, params))
            self.base = params
            steps = run.trainer.step - f.step0
            if final:
                f.landed = steps
            else:
                f.previews.append(steps)
        if not f.future.done():
            return
        self._landed = self._join()
        if self.stale or self.base is None or self._landed is None:
            return
        if f.landed is None:
            f.landed = run.trainer.step - f.step0
            anchor = run.state.anchor.snapshot()
            run.trainer.shift_params(landing_shift(self.base, anchor))
            self.base = anchor
        self._landed.landed_after = f.landed
        self._landed.previews = list(f.previews)

    def run_round(self) -> RoundStats | None:
        """Train phase ``runner.round``, then hand its exchange to the background; returns the report of the round
        whose exchange just finished (None on the first call, or when it was abandoned)."""
        run = self.runner
        r = run.state.round
        if self.base is None:
            run.load_anchor_into_model()
        stats, steps, tokens, _ = run.begin_round(r)
        f = self.inflight
        finished = self._join() if f is not None else self._landed
        if f is not None and finished is not None:  # joined at the phase's end: what landed before it still counts
            finished.landed_after, finished.previews = f.landed, list(f.previews)
        self._landed = None
        snapshot = run.state.anchor.snapshot()  # read back as it is now while the next exchange replaces it
        t1 = time.perf_counter()
        base = self.base if self.base is not None else run.state.anchor
        if self.stale:
            # phase r trained from parameters a resync has since replaced: its steps are not a pseudo-gradient of
            # anything the others hold, so it sits this round out (weight 0), as a freshly synced peer does
            logger.info("round %d: discarding the inner phase trained before the resync", r)
            steps = tokens = 0
            self.stale, base = False, run.state.anchor
        run.save_if_due()
        mine: dict[int, Contribution] = run.contribute(r, stats, steps, tokens, base)
        own = self._own(mine)
        self.base = phase_start(run.cfg.overlap, run.outer_cfg, run.state.anchor.snapshot(), own, self._expected())
        run.trainer.load_params(self.base)
        run.overlapping = True  # from here the exchange thread must not touch the model
        run.state.round = r + 1  # the main thread owns the round counter (a resync in the exchange may move it further)
        main_comm_s = time.perf_counter() - t1
        # bytes served from here to the join: this round's payload and state (the previous round's were counted)
        served_before = run.bytes_served()
        with self._lock:
            self._offer = None  # an offer of the round just joined that no step was left to land
        self.inflight = _InFlight(r, stats, steps, served_before, Future(), main_comm_s, run.trainer.step,
                                  dict(mine))
        self.inflight.future = self.pool.submit(run.exchange, r, stats, mine)  # set first: preview() reads it
        if finished is None:
            return None
        return self.report(finished, snapshot)

    def _own(self, mine: dict[int, Contribution]) -> Contribution | None:
        """Our contribution to the round in flight as one contribution over every held shard (None: none)."""
        if not mine:
            return None
        tensors: dict[str, Any] = {}
        for c in mine.values():
            tensors.update(c.tensors)
        first = next(iter(mine.values()))
        return Contribution(first.sender, first.tokens, tensors)

    def report(self, stats: RoundStats, params: dict[str, Any] | None = None) -> RoundStats:
        _, checks, steps = self._last
        return self.runner.report(stats, checks, steps, params)

    def quiesce(self) -> None:
        """Wait for the exchange in flight, if any, ignoring its outcome (the run is ending on an error)."""
        f, self.inflight = self.inflight, None
        if f is not None:
            f.future.exception()
        self.runner.overlapping = False

    def finish(self) -> RoundStats | None:
        """Join the exchange in flight (at stop or after the last round) and report it. No phase trains between two
        calls (each call trains, then contributes), so nothing is left unsent: a phase cut short by SIGTERM was
        contributed by its call, and its round, abandoned, put it back into the error-feedback buffer."""
        run = self.runner
        finished = self._join()
        run.overlapping = False
        self.base, self.stale = None, False
        run.load_anchor_into_model()  # the model (and the checkpoint's copy of it) hold the agreed parameters
        self.pool.shutdown(wait=True)
        if finished is None:
            return None
        return self.report(finished)
