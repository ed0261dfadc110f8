"""The auditor's shell: which frames of a stage peer to check, fetched from the peers that hold them, and the
finding of :func:`hlbp.peer.swarm.audit.audit` on each.

For a stage peer P and an outer round r, the auditor reads the round's transcript index of P and of the swarm's
other peers (``audit/i/<r>``, :mod:`hlbp.protocol.transcript`). What P *sent* is listed by its neighbours, who hold
it signed by P, so P cannot keep a micro-batch out of the sample by leaving it out of its own index; what P
*received* it must show from its own transcript, signed by the neighbour that sent it. The micro-batch attempts to
check are drawn from a seed the auditor chooses after the traffic, so no stage peer knew, when it computed, which
ones would be looked at: attempts of the phase's first step, where the peer's weights are exactly the anchor, and
a few attempts of one later step, judged against each other (:func:`~hlbp.peer.swarm.audit.judge_step`).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

import torch

from hlbp.peer.model.codec import ActivationCodec
from hlbp.peer.model.decoder import Stage
from hlbp.peer.swarm.audit import AuditResult, Evidence, Finding, Frame, Tolerance, audit, judge_step
from hlbp.peer.train.turns import Turns, side_turn
from hlbp.protocol import ProtocolError
from hlbp.protocol.transcript import FrameKey, RoundIndex, decode_index, decode_kept, index_name

logger = logging.getLogger(__name__)

Fetch = Callable[[str, str, int, float], bytes]
"""``fetch(peer, name, max_size, timeout)``: a blob from a peer's data plane (``BlobTransport.fetch``); raises
``ConnectionError`` (or a subclass) when it cannot."""

MicroBatchKey = tuple[int, int, int, int]  # (session, step, mb, attempt)
RETRY_PAUSE_S = 0.25  # before a fetch that failed fast is asked again


@dataclass(frozen=True)
class Verdict:
    """The finding on one micro-batch attempt that ``accused`` passed on in round ``round``, and who held each
    frame (the evidence anyone can fetch again and recompute)."""

    accused: str
    round: int
    micro_batch: MicroBatchKey
    result: AuditResult
    holders: dict[str, str] = field(default_factory=dict)  # "x" / "y" / "g_out" / "g_in" -> the peer that held it

    @property
    def guilty(self) -> bool:
        return self.result.finding.guilty


@dataclass(frozen=True)
class PeerAudit:
    """The findings on the micro-batch attempts of ``accused`` sampled in round ``round``, and the peers it
    exchanged frames with in that round, each way as the peer that holds the frames says: ``reached``, the peers
    whose own transcripts list frames the accused sent (the work a lie of its reached), and ``fed_by``, the peers
    whose frames the accused's transcript lists (what its own work was computed from). A transcript speaks for its
    holder only: the accused cannot make another peer's list a frame of its, so naming an honest peer of another
    swarm in its own transcript puts that peer in its ``fed_by``, never in its ``reached``."""

    accused: str
    round: int
    verdicts: list[Verdict]
    reached: frozenset[str]
    compute_s: float = 0.0  # seconds spent recomputing (the rest of an audit's time is fetching frames)
    flagged: int = 0  # micro-batch attempts of the accused that a receiver's screen marked in the round
    # each neighbour's side: -1 upstream (it sent the accused activations, or got gradients from it), +1 downstream
    sides: Mapping[str, int] = field(default_factory=dict)
    fed_by: frozenset[str] = frozenset()
    withdrawn: bool = False  # the accused's index takes its work of the round back: nothing of it was recomputed

    @property
    def neighbours(self) -> frozenset[str]:
        """Every peer the accused exchanged frames with, either way."""
        return self.reached | self.fed_by

    def exchanges(self) -> set[tuple[str, str]]:
        """The round's frame exchanges this audit shows, as (sender, holder) pairs, each as its holder says."""
        return {(self.accused, p) for p in self.reached} | {(p, self.accused) for p in self.fed_by}

    @property
    def guilty(self) -> Verdict | None:
        """The first finding that convicts the accused, or None."""
        return next((v for v in self.verdicts if v.guilty), None)

    @property
    def stale(self) -> Verdict | None:
        """The first finding that its work of the round was computed on other weights than the anchor, or None."""
        return next((v for v in self.verdicts if v.result.finding is Finding.STALE), None)


@dataclass(frozen=True)
class AuditConfig:
    samples: int = 1  # micro-batch attempts of the phase's first step judged per stage peer and round
    later: int = 2  # micro-batch attempts of one later step, judged against each other, per peer and round
    # the chance that they are drawn for a peer none of whose later frames a receiver's screen marked (a marked one
    # is always drawn): the screen raises the audit rate of what looks odd from this base to 1, and the rest costs a
    # quarter (docs/security.md: the cost at make demo's settings)
    later_chance: float = 0.25
    timeout_s: float = 3.0  # per fetch: a peer that does not answer within it shows nothing (inconclusive)
    budget_s: float = 15.0  # most seconds a coordinator spends auditing one round (a round's close waits for it)
    tolerance: Tolerance = field(default_factory=Tolerance)


def fetch_again_if_fast(fetch: Fetch, peer: str, name: str, max_size: int, timeout_s: float) -> bytes:
    """``fetch(peer, name, max_size, timeout_s)``, asked once more after a failure that came back within half the
    timeout: a stream broken on a loaded box (seen in a test run: a stage peer's listed input frame was not had, and
    its swarm's round was refused as unchecked). A peer that let the request time out is not asked again: it would
    spend the round's audit budget twice as fast. Raises what the last try raised."""
    started = time.monotonic()
    try:
        return fetch(peer, name, max_size, timeout_s)
    except ConnectionError:
        if time.monotonic() - started > timeout_s / 2:
            raise
    time.sleep(RETRY_PAUSE_S)
    return fetch(peer, name, max_size, timeout_s)


def choose(sent: dict[MicroBatchKey, int], count: int, seed: int, later: int = 0,
           flagged: AbstractSet[MicroBatchKey] = frozenset(), later_chance: float = 1.0) -> list[MicroBatchKey]:
    """``count`` of the micro-batch attempts in ``sent`` (each with the inner step it belongs to) of the phase's
    first step, and ``later`` attempts of one later step (judged against each other, so a step with at least two
    is drawn where there is one), all drawn by ``seed``. Attempts a receiver's screen marked (``flagged``,
    :mod:`hlbp.peer.swarm.screen`) come first: of the first step's, and the later step drawn is one with a marked
    attempt where there is one, its marked attempts among those drawn; with none marked, a later step is drawn with
    probability ``later_chance``."""
    rng = random.Random(seed)
    keys = sorted(sent)
    first = [k for k in keys if sent[k] == 0]
    marked = [k for k in first if k in flagged]
    rest = [k for k in first if k not in flagged]
    picked = rng.sample(marked, min(len(marked), count))
    picked += rng.sample(rest, min(len(rest), count - len(picked)))
    if later:
        steps: dict[tuple[int, int], list[MicroBatchKey]] = {}
        for k in keys:
            if sent[k] != 0:
                steps.setdefault((k[0], k[1]), []).append(k)
        groups = [g for g in steps.values() if len(g) >= 2] or list(steps.values())
        hot = [g for g in groups if any(k in flagged for k in g)]
        if groups and (hot or rng.random() < later_chance):
            group = (hot or groups)[rng.randrange(len(hot or groups))]
            marked = [k for k in group if k in flagged]
            take = rng.sample(marked, min(len(marked), max(later - 1, 1)))
            others = [k for k in group if k not in take]
            picked += take + rng.sample(others, min(len(others), later - len(take)))
    return picked


class Auditor:
    """Audits stage peers of a round by fetching the frames they exchanged (``fetch``) and recomputing their
    stage at the anchor. ``max_body``: the largest stage message body the run allows."""

    def __init__(self, fetch: Fetch, codec: ActivationCodec, vocab_size: int, max_body: int,
                 cfg: AuditConfig | None = None, turns: Turns | None = None) -> None:
        self.fetch, self.codec, self.vocab_size, self.max_body = fetch, codec, vocab_size, max_body
        self.turns = turns  # each recomputation waits for the auditing peer's training step under way (None: no wait)
        self.cfg = cfg or AuditConfig()
        self._indexes: dict[tuple[str, int], RoundIndex] = {}  # (peer, round) -> its index, this round only

    def _fetch(self, peer: str, name: str, max_size: int) -> bytes:
        return fetch_again_if_fast(self.fetch, peer, name, max_size, self.cfg.timeout_s)

    def _index(self, peer: str, r: int) -> RoundIndex:
        """``peer``'s index of round ``r``, fetched once per round (every audit of the round reads them)."""
        if (peer, r) not in self._indexes:
            self._indexes = {k: v for k, v in self._indexes.items() if k[1] >= r}
            try:
                self._indexes[(peer, r)] = decode_index(self._fetch(peer, index_name(r), 16 << 20))
            except (ConnectionError, ProtocolError) as exc:
                logger.info("no audit index of round %d from %s: %s", r, peer[:12], exc)
                self._indexes[(peer, r)] = RoundIndex([])
        return self._indexes[(peer, r)]

    def _frame(self, holder: str, key: FrameKey) -> Frame | None:
        try:
            return decode_kept(self._fetch(holder, key.name, self.max_body + 8192), key, self.max_body)
        except (ConnectionError, ProtocolError) as exc:
            logger.info("frame %s not had from %s: %s", key.name, holder[:12], exc)
            return None

    def _recompute(self, stage: Stage, fetched: Sequence[tuple[MicroBatchKey, dict[str, Frame | None], dict[str, str]]],
                   params: Mapping[str, torch.Tensor] | None) -> tuple[list[tuple[MicroBatchKey, AuditResult, dict[str, str]]], float]:
        """Each fetched sample's finding and the seconds recomputing took, in one turn: the stage's parameters are
        read (once for every sample) and dropped within it."""
        found: list[tuple[MicroBatchKey, AuditResult, dict[str, str]]] = []
        compute_s = 0.0
        with side_turn(self.turns):
            own = None if params is None else {n: params[n] for n, _ in stage.named_parameters()}
            for mb, frames, held in fetched:
                evidence = Evidence(frames["x"], frames["y"], frames["g_out"], frames["g_in"])
                t0 = time.perf_counter()
                result = audit(stage, self.codec, self.vocab_size, evidence, self.cfg.tolerance, own)
                compute_s += time.perf_counter() - t0
                unfetched = sorted(name for name in held if frames[name] is None)
                if result.finding is Finding.INCONCLUSIVE and unfetched:  # listed by its holder, not had in time
                    result = AuditResult(Finding.INCONCLUSIVE, detail=f"could not fetch {', '.join(unfetched)} "
                                                                      "from the peers that list them")
                elif result.finding is Finding.INCONCLUSIVE and not stage.is_first and evidence.x is None:
                    result = AuditResult(Finding.INCONCLUSIVE, detail="it did not show the input it passed on")
                found.append((mb, result, held))
        return found, compute_s

    def audit_peer(self, r: int, accused: str, stage: Stage, swarm: Sequence[str], seed: int,
                   params: Mapping[str, torch.Tensor] | None = None, samples: int | None = None) -> PeerAudit:
        """Findings on a sample of the micro-batch attempts ``accused`` passed on in round ``r``, recomputed on
        ``stage`` at the anchor of round r's phase (``params``, or ``stage``'s own weights); ``swarm``: the peers
        that may hold its frames; ``samples`` overrides the configured count (0: only who its neighbours were).

        Every sample's frames are fetched first; then, in one turn (:attr:`turns`), the stage's parameters are read
        (a stored anchor reads a file) and every sample recomputed, so neither the parameters nor the recomputation
        are held while the frames travel beside the auditing peer's training step. The frames of every sample (at
        most ``samples + later``, four each, each at most ``max_body``) are held together until then."""
        index = self._index(accused, r)
        own = index.entries
        received = {(e.key.op, e.key.micro_batch()): e.key for e in own}
        # each neighbour's side: -1 upstream (it sent us activations), +1 downstream (it sent us gradients)
        sides = {e.key.sender: -1 if e.key.op == "fwd" else 1 for e in own}
        fed_by = frozenset(sides) - {accused}
        reached: set[str] = set()
        sent: dict[MicroBatchKey, int] = {}
        flagged: set[MicroBatchKey] = set()  # what a receiver's screen marked
        holders: dict[tuple[str, MicroBatchKey], tuple[str, FrameKey]] = {}
        # whoever sent it frames holds what it sent back to them: asked even when it is not in ``swarm`` (a peer
        # that joined mid-round and contributed nothing yet still holds the frames it exchanged with the accused)
        for peer in dict.fromkeys([*swarm, *sorted(sides)]):
            if peer == accused:
                continue
            for e in self._index(peer, r).entries:
                if e.key.sender == accused:
                    sides.setdefault(peer, 1 if e.key.op == "fwd" else -1)
                    reached.add(peer)
                    mb = e.key.micro_batch()
                    holders[(e.key.op, mb)] = (peer, e.key)
                    sent.setdefault(mb, e.inner)
                    if e.flagged:
                        flagged.add(mb)
        # a withdrawn round is not recomputed: the accused says its work is not at the anchor, and it and its
        # chain are left out whatever a sample would show (a liar can withdraw too, taking its lie's reach with it)
        count = 0 if index.withdrawn else self.cfg.samples if samples is None else samples
        # stage 0's later steps are not judged: its siblings are not alike by construction (the embedding rows a
        # micro-batch reads drift with how often the phase trained those tokens), so they would convict an honest
        # driver; its first step is recomputed exactly like any stage's
        later = self.cfg.later if count and not stage.is_first else 0
        fetched: list[tuple[MicroBatchKey, dict[str, Frame | None], dict[str, str]]] = []
        for mb in choose(sent, count, seed, later, flagged, self.cfg.later_chance):
            frames: dict[str, Frame | None] = {}
            held: dict[str, str] = {}
            for name, op in (("y", "fwd"), ("g_in", "bwd")):
                where = holders.get((op, mb))
                frames[name] = None if where is None else self._frame(*where)
                if where is not None:
                    held[name] = where[0]
            for name, op in (("x", "fwd"), ("g_out", "bwd")):
                key = received.get((op, mb))
                frames[name] = None if key is None else self._frame(accused, key)
                if key is not None:
                    held[name] = accused
            fetched.append((mb, frames, held))
        found, compute_s = self._recompute(stage, fetched, params) if fetched else ([], 0.0)
        judged = judge_step([res for _, res, _ in found], self.cfg.tolerance)
        verdicts = [Verdict(accused, r, mb, res, held) for (mb, _, held), res in zip(found, judged)]
        sides.pop(accused, None)
        return PeerAudit(accused, r, verdicts, frozenset(reached), compute_s, len(flagged), sides, fed_by,
                         index.withdrawn)
