"""A full replica's NoLoCo rounds over the network: no accepted set, no coordinator, no all-reduce.

One round r of a replica (the outer step itself: :mod:`hlbp.peer.rounds.noloco`):

1. Inner phase: H AdamW steps from its own outer weights φ.
2. Its message for the round (progress and φ, dense or sparse) is served on the data plane as ``noloco/m/<r>``.
3. Its partner is :func:`~hlbp.peer.rounds.noloco.partners` of the run's online full replicas (the signed
   announcements every peer reads), the seed and the round: no message decides it.
4. It fetches the partner's round-r message, retrying until the round's window has passed; a partner that is not
   there by then (slow, dead, in another round, or seeing another set of peers and so pairing elsewhere) is not
   waited for: the step is taken alone. A message that breaks the protocol is refused and its sender counted as
   failed for a while; one within the protocol is bounded against our own progress (``progress_bound``,
   ``pull_bound``).
5. The outer step; the inner phase of round r + 1 starts from the new φ.

What replaces a run's invariants: replicas never agree bit for bit, so there are no checksums to vote on. A joiner
loads the outer weights of one online replica (``s/noloco``, whatever round it is at) and takes up that round; a
restarted replica resumes its checkpoint (φ, momentum, error feedback) and takes up the current round of the
replica it asks. Spread, not agreement, is what a run reports (its peers' final checkpoints).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hlbp.peer.net.transport import STATE_PREFIX, BlobTransport, TransportError
from hlbp.peer.rounds.contribution import contribution_from_bytes, contribution_to_bytes
from hlbp.peer.rounds.noloco import (
    NoLoCoConfig,
    NoLoCoState,
    PairMessage,
    message,
    message_from_bytes,
    message_to_bytes,
    partners,
    step,
)
from hlbp.peer.rounds.outer import Contribution, OuterConfig
from hlbp.peer.train.checkpoint import load_checkpoint, save_checkpoint
from hlbp.peer.train.metricslog import MetricsLog
from hlbp.peer.train.trainer import InnerTrainer
from hlbp.protocol import ProtocolError
from hlbp.protocol.envelope import unpack

logger = logging.getLogger(__name__)

# under the state prefix, so requests for it are rate-limited like any state shard's (a flood of them would make us
# encode the whole model again and again)
STATE_NAME = f"{STATE_PREFIX}noloco"
FAIL_ROUNDS = 4  # a partner whose message broke the protocol is skipped (stepped alone) this many rounds
# served once a replica's runner has started (model built, state taken up): replicas started together wait for each
# other's before round 0, since an announcement comes before the model and the data are ready
READY_NAME = "noloco/ready"
READY_BLOB = b"ready"


def message_name(round_: int) -> str:
    return f"noloco/m/{round_}"


@dataclass
class MessageEncoder:
    """Our message for a round as the wire carries it (the part a fault test wraps to send a lie)."""

    cfg: NoLoCoConfig
    me: str
    run_id: str

    def encode(self, r: int, msg: PairMessage) -> bytes:
        return message_to_bytes(msg, self.cfg, self.me, self.run_id, r)


@dataclass
class NoLoCoRound:
    """What one round did for this replica (the metrics record and the log line)."""

    round: int
    steps: int
    partner: str | None  # whom the seeded pairs gave us
    paired: bool  # its message arrived and passed the checks
    train_loss: float
    val_loss: float | None
    wait_s: float  # seconds spent fetching the partner's message
    bytes_sent: int  # our message's bytes (served; counted whoever fetches it)
    bytes_received: int
    bounded: int  # the partner's tensors scaled down to the bounds this round
    seconds: float
    compute_s: float = 0.0  # the inner phase
    comm_s: float = 0.0  # the rest of the round beside the wait: encoding, the partner's message, the step


class NoLoCoRunner:
    """A full replica's NoLoCo rounds (see the module docstring). ``peers()``: the run's online full replicas as
    the announcements show them (ours included); ``window_s``: how long a round waits for its partner's message."""

    def __init__(self, me: str, trainer: InnerTrainer, transport: BlobTransport, peers: Callable[[], set[str]],
                 cfg: NoLoCoConfig, run_id: str, seed: str, inner_steps: int, window_s: float,
                 stop: threading.Event, checkpoint: Path | None = None, metrics: MetricsLog | None = None,
                 evaluate: Callable[[Mapping[str, torch.Tensor]], float | None] | None = None,
                 on_round: Callable[[NoLoCoRound], None] | None = None, fetch_timeout_s: float = 10.0) -> None:
        cfg.validate()
        self.me, self.trainer, self.transport, self.peers, self.cfg = me, trainer, transport, peers, cfg
        self.run_id, self.seed, self.inner_steps, self.window_s = run_id, seed, inner_steps, window_s
        self.stop, self.checkpoint, self.metrics = stop, checkpoint, metrics or MetricsLog(None)
        self.evaluate, self.on_round, self.fetch_timeout_s = evaluate, on_round, fetch_timeout_s
        params = {n: p.detach() for n, p in trainer.model.named_parameters()}
        self.shapes = {n: tuple(t.shape) for n, t in params.items()}
        self.state = NoLoCoState.start(params)
        self.round = 0
        self.failed: dict[str, int] = {}  # partner -> the round until which it is skipped
        self.history: list[NoLoCoRound] = []
        self.encoder = MessageEncoder(cfg, me, run_id)
        self._lock = threading.Lock()  # the served state is read between two steps, never during one
        self._ready: set[str] = set()  # peers seen serving READY_NAME
        n_params = sum(t.numel() for t in params.values())
        # dense: two fp32 tensors of the model; sparse: SparseLoCo's bound (6 B a value) and φ at its positions
        self.max_message_bytes = (8 if cfg.sparse else 16) * n_params + (1 << 20)
        self.transport.put_lazy(STATE_NAME, self._state_blob)

    # -- start ---------------------------------------------------------------------------------------------------

    def start(self) -> str:
        """Resume our checkpoint if there is one, then take up the run's current round from an online replica
        (a fresh joiner also loads its outer weights). Returns what happened, for the log."""
        resumed = self._resume()
        donor = self._fetch_state()
        if donor is None:
            how = f"resumed from checkpoint at round {self.round}" if resumed else "fresh start"
        else:
            peer, round_, phi = donor
            if not resumed:
                with self._lock:
                    self.state = NoLoCoState.start(phi)
                how = f"loaded the outer weights of {peer[:16]} (round {round_})"
            else:
                how = f"resumed from checkpoint; the run is at round {round_ + 1}"
            self.round = max(self.round, round_ + 1)
        self._load_model()
        self.transport.put(READY_NAME, READY_BLOB)
        return how

    def ready_replicas(self, timeout_s: float = 1.0) -> set[str]:
        """The online replicas (us included) whose runner has started: they serve :data:`READY_NAME`. A fresh
        run's first round waits for these, not for the announcements: a replica announces before it has loaded
        its data and built its model, which on a loaded machine took longer than a round's window, and a partner
        drawn for round 0 that is still starting makes the other step alone (seen in CI). A peer seen ready stays
        counted; each other one costs one short fetch a call."""
        for peer in sorted(self.peers() - self._ready - {self.me}):
            try:
                if self.transport.fetch(peer, READY_NAME, len(READY_BLOB), timeout_s) == READY_BLOB:
                    self._ready.add(peer)
            except (TransportError, ProtocolError):
                continue
        return self._ready | {self.me}

    def _resume(self) -> bool:
        if self.checkpoint is None or not self.checkpoint.exists():
            return False
        tensors, header = load_checkpoint(self.checkpoint)
        if header.get("run") != self.run_id or header.get("outer") != "noloco":
            logger.warning("ignoring %s: not a checkpoint of this NoLoCo run", self.checkpoint)
            return False
        phi = {n[4:]: t for n, t in tensors.items() if n.startswith("phi.")}
        if {n: tuple(t.shape) for n, t in phi.items()} != self.shapes:
            logger.warning("ignoring %s: its tensors are not this model's", self.checkpoint)
            return False
        with self._lock:
            self.state = NoLoCoState(
                {n: t.float().clone() for n, t in phi.items()},
                {n[2:]: t.float().clone() for n, t in tensors.items() if n.startswith("m.")},
                {n[3:]: t.float().clone() for n, t in tensors.items() if n.startswith("ef.")})
        self.round = int(header.get("round", 0))
        return True

    def save(self) -> None:
        """Save φ, the momentum, the error feedback and the next round (atomic)."""
        if self.checkpoint is None:
            return
        with self._lock:
            tensors = {**{f"phi.{n}": t for n, t in self.state.phi.items()},
                       **{f"m.{n}": t for n, t in self.state.momentum.items()},
                       **{f"ef.{n}": t for n, t in self.state.ef.items()}}
            save_checkpoint(self.checkpoint, tensors, {"run": self.run_id, "outer": "noloco", "round": self.round})

    def _state_blob(self) -> bytes | None:
        """Our outer weights as of the last round, for a joiner (dense fp32, the round in the envelope); None
        ("not here") before our first round: a run that has not begun has no state to take up."""
        with self._lock:
            if self.round == 0:
                return None
            phi = {n: t.clone() for n, t in self.state.phi.items()}
            round_ = self.round - 1
        return contribution_to_bytes(Contribution(self.me, 0, phi), _DENSE, run=self.run_id, round=round_, shard=0)

    def _fetch_state(self) -> tuple[str, int, dict[str, torch.Tensor]] | None:
        """The outer weights of one online replica and the round they are of, or None (nobody else online, or
        nobody answered)."""
        others = sorted(self.peers() - {self.me})
        random.Random(self.me).shuffle(others)
        for peer in others[:3]:
            try:
                data = self.transport.fetch(peer, STATE_NAME, self.max_message_bytes, self.fetch_timeout_s)
                round_ = unpack(data, self.max_message_bytes)[0].round
                phi = contribution_from_bytes(data, _DENSE, self.shapes, run=self.run_id, shard=0).tensors
            except (TransportError, ProtocolError) as exc:
                logger.info("no NoLoCo state from %s (%s)", peer[:16], str(exc)[:120])
                continue
            if all(bool(torch.isfinite(t).all()) for t in phi.values()):
                return peer, round_, {n: t.float() for n, t in phi.items()}
        return None

    # -- rounds --------------------------------------------------------------------------------------------------

    def run(self, max_rounds: int | None = None) -> list[NoLoCoRound]:
        """Rounds until stopped or ``max_rounds`` are done; the checkpoint is saved at the end whatever happens.
        After the last of ``max_rounds`` our message stays served until the partner has fetched it (see
        :meth:`linger`)."""
        try:
            while not self.stop.is_set() and (max_rounds is None or len(self.history) < max_rounds):
                done = self.run_round()
                if done is not None:
                    self.history.append(done)
            if self.history and not self.stop.is_set():
                self.linger(self.history[-1])
        finally:
            self.save()
        return self.history

    def linger(self, last: NoLoCoRound) -> bool:
        """Stay in the run for a round's window after the ``last`` round, announced and serving our message of it:
        a replica that left the moment it had stepped would leave its partner, still fetching, to step alone, and
        a replica still starting that round would read a run without it and pair differently from those that read
        it with it (seen under a busy loop: asymmetric pairs in a run's last round). Returns whether the partner
        was sent our message (True too when there was nobody to wait for)."""
        partner = last.partner
        deadline = time.monotonic() + self.window_s
        name = message_name(last.round)
        while (left := deadline - time.monotonic()) > 0 and not self.stop.wait(min(0.1, left)):
            pass
        if partner is None or self.failed.get(partner, -1) >= last.round:
            return True
        return partner in self.transport.readers(name)

    def run_round(self) -> NoLoCoRound | None:
        """One round (see the module docstring); None when stopped mid-phase (the steps stay in the model)."""
        r, t0 = self.round, time.perf_counter()
        losses = []
        for _ in range(self.inner_steps):
            if self.stop.is_set():
                return None
            losses.append(self.trainer.train_step())
        compute_s = time.perf_counter() - t0
        theta = {n: p.detach() for n, p in self.trainer.model.named_parameters()}
        mine = message(self.state, theta, self.cfg)
        blob = self.encoder.encode(r, mine)
        self.transport.put(message_name(r), blob)
        self.transport.drop([message_name(r - 2)])
        partner = partners(self.peers() | {self.me}, self.seed, r).get(self.me)
        t1 = time.perf_counter()
        theirs, received = self._partner_message(partner, r)
        wait_s = time.perf_counter() - t1
        before = self.state.bounded
        with self._lock:
            step(self.state, mine, theirs, self.cfg)
            self.round = r + 1
        self._load_model()
        exchange_s = time.perf_counter() - t0 - compute_s
        val = self.evaluate(self.state.phi) if self.evaluate is not None else None
        done = NoLoCoRound(r, len(losses), partner, theirs is not None, sum(losses) / max(1, len(losses)), val,
                           wait_s, len(blob), received, self.state.bounded - before, time.perf_counter() - t0,
                           compute_s, max(0.0, exchange_s - wait_s))
        self.metrics.write(event="round", **{k: v for k, v in done.__dict__.items()})
        if self.on_round is not None:
            self.on_round(done)
        return done

    def _partner_message(self, partner: str | None, r: int) -> tuple[Any, int]:
        """The partner's round-r message and its size, or (None, 0) when there is none in time (see step 4)."""
        if partner is None or self.failed.get(partner, -1) >= r:
            return None, 0
        deadline = time.monotonic() + self.window_s
        while not self.stop.is_set():
            left = deadline - time.monotonic()
            try:
                data = self.transport.fetch(partner, message_name(r), self.max_message_bytes,
                                            max(0.5, min(self.fetch_timeout_s, left)))
            except ProtocolError as exc:
                self._fail(partner, r, str(exc))
                return None, 0
            except TransportError:
                if left <= 0:
                    return None, 0
                self.stop.wait(min(0.25, max(0.0, left)))  # not served yet: its phase is still running
                continue
            try:
                return message_from_bytes(data, self.cfg, self.shapes, self.run_id, r), len(data)
            except ProtocolError as exc:
                self._fail(partner, r, str(exc))
                return None, 0
        return None, 0

    def _fail(self, partner: str, r: int, why: str) -> None:
        logger.warning("round %d: the message of %s breaks the protocol (%s); stepping alone, and without it "
                       "for %d rounds", r, partner[:16], why[:160], FAIL_ROUNDS)
        self.failed[partner] = r + FAIL_ROUNDS

    def _load_model(self) -> None:
        with self._lock:
            self.trainer.load_params(self.state.phi)


_DENSE = OuterConfig(kind="diloco", wire_dtype="fp32")
