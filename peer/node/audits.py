"""A full replica's audits of the run's pipeline swarms, run when it coordinates a round.

A coordinator that holds every shard checks, before it accepts a stage peer's contribution to round r, a few of
the micro-batches that peer passed on during round r's phase (:class:`hlbp.peer.swarm.auditor.Auditor`): it fetches
the signed frames from the peers that hold them and recomputes the stage at the anchor it holds itself, the one the
swarm started the phase from. A peer whose own signed frames convict it is banned and its contribution refused;
the contributions of every peer joined to it through the round's frame exchanges are refused too, without a ban:
its neighbours computed their gradients and activations from what it sent, and the peers beyond them from what its
neighbours sent on (:func:`chain_of`: in a swarm of four or more stages a lie reaches peers two hops away). A peer whose frames are near but not equal to its
stage's output at the anchor computed on other weights (it had not loaded the round's result when it served the
step): its work and its chain's are left out of the round, and nobody is banned. Work nothing of which could be
checked (no frame of the phase's first step shown, or the audits' time budget for the round spent) is left out
too, without a ban (:func:`judge`), with its chain's. Whoever is left out without a ban is named in the round's
accepted set (``AcceptedSet.dropped``) and takes that phase out of its error feedback: kept, work computed with
frames nobody could check would be sent, unaudited, in a later round. A peer that passed frames on without
contributing is audited as well, at the stage its own announcement names where its neighbours' transcripts agree
(:func:`unaudited_neighbours`): a liar that never announces a contribution still reaches the work of the peers that
do. Which micro-batches are checked is drawn from this process's own randomness after the traffic, so no stage peer
could know it when it computed.

Every audit is written to ``metrics.jsonl`` (event ``audit``: the round, the peer, each sample's finding, inner step,
and the distances), which is how the tests and an operator see them.

A convicted peer taints the work of whoever trades frames with it for as long as its ban lasts here
(:class:`Convictions`: 2, 4, 8, ... rounds, as :class:`hlbp.peer.rounds.bans.RoundBans` bans it), not for good: a
taint for good left its swarm's other stages out of every later round. A stage peer whose resync replaced the state
its phase trained from is not convicted: one that knew in time withdrew the phase (``PeerAudit.withdrawn``), and one
whose verdict came after the round's audits had published checksums of that state which differ from the anchor's
(:func:`disowned`).

A peer whose index withdraws its work of a round is not banned for it once: an honest peer does that after a resync
replaced the state its phase trained from. Each withdrawal still costs its whole chain that round's work, so a peer
that withdraws again and again would make its swarm's work worthless for good while looking honest. When two of a
peer's last ``WITHDRAW_AUDITS`` audits by this coordinator found its work taken back, in rounds not adjacent
(:class:`Withdrawals`), it is banned as undelivered work (as the miss rule bans, :mod:`hlbp.peer.rounds.bans`): not
as a liar, so its neighbours' work is not tainted, and its swarm's drivers route around it while the ban lasts.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from hlbp.peer.model.codec import ActivationCodec
from hlbp.peer.model.decoder import ModelConfig, Stage
from hlbp.peer.rounds.admission import Refusal
from hlbp.peer.rounds.anchor import Anchor
from hlbp.peer.rounds.bans import ban_end
from hlbp.peer.rounds.statesync import shard_checksum
from hlbp.peer.swarm.audit import Finding
from hlbp.peer.swarm.auditor import AuditConfig, Auditor, Fetch, PeerAudit
from hlbp.peer.train.trainer import skeleton
from hlbp.peer.train.turns import Turns
from hlbp.protocol.roundwire import ContribNotice

logger = logging.getLogger(__name__)


@dataclass
class Convictions:
    """The stage peers this coordinator's audits convicted, each a liar until its ban here ends: 2 rounds after
    the round of its first conviction, 4 after its second, 8 ... (``until``: peer -> (first round it is no longer
    a liar, convictions so far)), the lengths :class:`hlbp.peer.rounds.bans.RoundBans` bans it for."""

    until: dict[str, tuple[int, int]] = field(default_factory=dict)

    def convict(self, peer: str, r: int) -> None:
        """``peer``'s frames of round ``r`` convicted it."""
        strikes = self.until.get(peer, (0, 0))[1] + 1
        self.until[peer] = (ban_end(r, strikes), strikes)

    def liars(self, r: int) -> set[str]:
        """The peers whose frames taint the work they reached in round ``r``."""
        return {p for p, (until, _) in self.until.items() if until > r}


WITHDRAW_AUDITS = 4  # a stage peer whose work two of its last this many audits here found taken back is banned
MAX_WITHDRAWERS = 4096  # peers whose audits are remembered


@dataclass
class Withdrawals:
    """Each stage peer's latest audits by this coordinator, and whether each found its work taken back (``seen``:
    peer -> (round, taken back) of its last ``WITHDRAW_AUDITS`` audits here since a peer first took work back; at
    most ``MAX_WITHDRAWERS`` peers, the least recently audited forgotten first).

    Counted per audit, not per round: with many full replicas each audits a peer seldom, and a window of rounds
    would let a peer take its work back every round without one coordinator seeing it twice."""

    seen: dict[str, list[tuple[int, bool]]] = field(default_factory=dict)

    def audited(self, peer: str, r: int, taken_back: bool) -> bool:
        """This coordinator audited ``peer``'s work of round ``r`` and found it ``taken_back`` (its index withdrew
        it, or its own checksums disowned the state it started from, :func:`disowned`) or not; returns whether two
        of its last ``WITHDRAW_AUDITS`` audits here found that for rounds at least two apart, which bans it. Those
        audits then count no more: a peer banned again needs two more. Two adjacent rounds are one incident: an
        honest peer's resync takes back the phase it spoils and the one it then sits out (both audited here when
        this coordinator closes both rounds)."""
        if not taken_back and peer not in self.seen:
            return False  # nothing taken back to count against it
        recent = ([x for x in self.seen.pop(peer, []) if x[0] != r] + [(r, taken_back)])[-WITHDRAW_AUDITS:]
        self.seen[peer] = recent
        while len(self.seen) > MAX_WITHDRAWERS:
            self.seen.pop(next(iter(self.seen)))
        backs = [x for x, back in recent if back]
        if len(backs) < 2 or max(backs) - min(backs) < 2:
            return False
        self.seen[peer] = []
        return True


class PipelineAudits:
    """The coordinator's screen (:class:`hlbp.peer.rounds.admission.Screen`) of stage peers' contributions.

    ``bounds``: the manifest's stage partition; ``codec``: the run's activation codec (its table is rebuilt from the
    anchor's embedding before each round's audits, as the stage peers rebuild theirs); ``anchor()``: the parameters
    of the round the phase under audit started from (the round loop's anchor while it closes the next round), or
    None when this peer's state is not the agreed one (it audits nothing then: a stale anchor would convict honest
    peers); ``metrics``: where each audit is written (anything with ``write(**record)``)."""

    def __init__(self, config: ModelConfig, bounds: list[tuple[int, int]], codec: ActivationCodec, vocab_size: int,
                 max_body: int, fetch: Fetch, anchor: Callable[[], Mapping[str, torch.Tensor] | None], metrics: Any,
                 cfg: AuditConfig | None = None, stage_of: Callable[[str], int | None] = lambda peer: None,
                 turns: Turns | None = None,
                 published: Callable[[str, int], tuple[int, str] | None] = lambda peer, shard: None) -> None:
        self.config, self.bounds, self.codec = config, bounds, codec
        self.anchor, self.metrics = anchor, metrics
        self.published = published  # a peer's latest published checksum of a shard, with its round (None: none)
        self.stage_of = stage_of  # the stage a peer's own signed announcement names (None: not known)
        self.auditor = Auditor(fetch, codec, vocab_size, max_body, cfg, turns)
        self._skeletons: dict[int, Stage] = {}
        self._lock = threading.Lock()  # one audit at a time: they share the codec's table and the skeletons
        self.audited = 0  # stage peers audited, for the summary
        self.caught: list[tuple[int, str]] = []  # (round, peer) of every conviction
        self.convictions = Convictions()  # work computed with a convicted peer's frames is not taken while it lasts
        self.withdrawals = Withdrawals()  # a peer that withdraws its work again and again is banned as a drag
        # built now, before training: a stage is made with its parameters (then dropped for the skeleton), and made
        # at a first audit, beside a training step, that transient added to the peer's peak (docs/design.md)
        for s in range(len(bounds)):
            self._skeleton(s)

    def _skeleton(self, s: int) -> Stage:
        """Stage ``s`` holding no parameter memory (its buffers are real): built once, run on the anchor."""
        if s not in self._skeletons:
            start, end = self.bounds[s]
            self._skeletons[s] = skeleton(Stage(self.config, start, end))
        return self._skeletons[s]

    def refuse(self, r: int, admitted: Mapping[str, ContribNotice]) -> dict[str, Refusal]:
        """The admitted contributions of round r to leave out, and why (see the module docstring)."""
        n = len(self.bounds)
        stage_peers = {p: next(iter(c.digests)) for p, c in admitted.items() if n > 1 and len(c.digests) == 1}
        if not stage_peers:
            return {}
        with self._lock:
            return self._refuse(r, stage_peers)

    def _refuse(self, r: int, stage_peers: dict[str, int]) -> dict[str, Refusal]:
        held = self.anchor()
        if held is None:
            logger.info("round %d: not auditing the stage peers: this peer's state is not the agreed one", r)
            return {}
        # round r - 1's parameters while the round replaces them: a snapshot of the anchor (each read when audited),
        # or a copy of the view's references (its tensors are replaced, never changed in place)
        anchor = held.snapshot() if isinstance(held, Anchor) else dict(held)
        if "embed.weight" in anchor:
            self.codec.rebuild_table(anchor["embed.weight"])  # B, A+drift: the table the swarm's phase used
        refused: dict[str, Refusal] = {}
        exchanged: set[tuple[str, str]] = set()  # round r's frame exchanges as (sender, holder), as holders say
        unchecked: set[str] = set()  # left out with nothing of theirs cleared: their frames fed their chain unchecked
        swarm = sorted(stage_peers)
        # in an order no peer can predict, within the round's budget: peers that answer slowly (or not at all, each
        # fetch waits out its timeout) can cost the close at most the budget, and cannot always starve the same ones
        order = sorted(stage_peers.items(), key=lambda item: secrets.randbits(64))
        queued = {p for p, _ in order}
        started = time.monotonic()
        i = 0
        while i < len(order):
            peer, s = order[i]
            if time.monotonic() - started > self.auditor.cfg.budget_s:
                late = [p for p, _ in order[i:]]
                logger.warning("round %d: the audits' budget of %.0f s is spent; leaving out the contributions of "
                               "%d stage peers not audited", r, self.auditor.cfg.budget_s, len(late))
                self.metrics.write(event="audit_budget", round=r, unaudited=late)
                for p in late:
                    refused.setdefault(p, Refusal(f"not audited within round {r}'s audit budget", ban=False))
                unchecked.update(late)
                break
            i += 1
            stage = self._skeleton(s)
            if any(name not in anchor for name, _ in stage.named_parameters()):
                continue  # a shard this coordinator does not hold (it is a stage peer itself)
            t0 = time.perf_counter()
            found = self.auditor.audit_peer(r, peer, stage, swarm, seed=secrets.randbits(64), params=anchor)
            # frames that convict are not a lie when the peer's own checksums already said its state was not the
            # anchor (its verification outlasted these audits, so it could not withdraw in time)
            off = found.guilty is not None and disowned(
                self.published(peer, s), r, partial(shard_checksum, anchor, [n for n, _ in stage.named_parameters()]))
            self.audited += 1
            self._record(found, s, time.perf_counter() - t0, off)
            if found.guilty is not None and not off:
                self.caught.append((r, peer))
                self.convictions.convict(peer, r)
            liars = self.convictions.liars(r)
            exchanged |= found.exchanges()
            if found.guilty is None and not checked(found):
                unchecked.add(peer)
            for p, refusal in judge(found, s, liars, off).items():
                refused.setdefault(p, refusal)
            if self.withdrawals.audited(peer, r, found.withdrawn or off):
                refused[peer] = Refusal(f"took back its work of round {r} (withdrawn or disowned), as in another of "
                                        f"its last {WITHDRAW_AUDITS} audits here: its swarm's work is worthless while "
                                        "it serves", ban=True, undelivered=True)
            # a peer that passed frames on in the chain without contributing is audited too: its lies reached the
            # work of the peers that did. Its stage is the one its own announcement names; the accused's transcript
            # only says where it stood, and a liar naming an honest peer at another stage would have it recomputed
            # on the wrong stage and convicted: a peer whose announcement disagrees is not audited, its frames count
            # as unchecked (the accused's chain's work is left out)
            audit_next, unplaced = unaudited_neighbours(found, s, len(self.bounds), queued, self.stage_of)
            order += audit_next
            unchecked.update(unplaced)
            queued.update(p for p, _ in audit_next)
            queued.update(unplaced)
        liars = self.convictions.liars(r)
        for p, liar in chain_of(liars, exchanged).items():
            if p in stage_peers:
                refused.setdefault(p, Refusal(f"its round-{r} work was computed in a chain with {liar[:16]}, caught "
                                              "lying", ban=False))
        # the work of a chain whose frames were not all cleared is left out with the peer that could not be checked:
        # it was computed on what that peer sent (a liar whose frames are not had, or whose audit the budget did not
        # reach, would otherwise see its neighbours' work taken, poisoned)
        for p, source in chain_of(unchecked - liars, exchanged).items():
            if p in stage_peers and p not in liars:
                refused.setdefault(p, Refusal(f"its round-{r} work was computed in a chain with {source[:16]}, whose "
                                              "frames could not be checked", ban=False))
        # a refusal matters for a contribution of this round, or as a ban (of a liar that did not contribute)
        return {p: refusal for p, refusal in refused.items() if refusal.ban or p in stage_peers}

    def _record(self, found: PeerAudit, stage: int, seconds: float, off: bool = False) -> None:
        samples = [{"finding": v.result.finding.value, "inner": v.result.inner, "step": v.micro_batch[1],
                    **({"detail": v.result.detail[:200]} if v.result.detail else {}),
                    "mb": v.micro_batch[2], "holders": sorted(v.holders),
                    **{k: [c.error, c.cosine, c.ratio] for k, c in (("forward", v.result.forward),
                                                                   ("backward", v.result.backward)) if c is not None}}
                   for v in found.verdicts]
        guilty = None if off else found.guilty
        if guilty is not None:
            logger.warning("round %d: stage peer %s of stage %d caught lying (%s)", found.round, found.accused[:16],
                           stage, guilty.result.finding.value)
        self.metrics.write(event="audit", round=found.round, peer=found.accused, stage=stage,
                           guilty=guilty is not None, withdrawn=found.withdrawn, disowned=off, samples=samples,
                           neighbours=sorted(found.neighbours), seconds=round(seconds, 4), compute_s=round(found.compute_s, 4), flagged=found.flagged)


def unaudited_neighbours(found: PeerAudit, stage: int, n_stages: int, audited: AbstractSet[str],
                         stage_of: Callable[[str], int | None]) -> tuple[list[tuple[str, int]], set[str]]:
    """The peers that ``found`` shows exchanging frames with its accused (of ``stage``) and that are not in
    ``audited``: (those to audit, each at its stage, in a fixed order; those that cannot be placed). A peer is
    placed where its side of the accused and its own announcement (``stage_of``) name the same stage (pure)."""
    place, unplaced = [], set()
    for p, side in sorted(found.sides.items()):
        if p in audited:
            continue
        if 0 <= stage + side < n_stages and stage_of(p) == stage + side:
            place.append((p, stage + side))
        else:
            unplaced.add(p)
    return place, unplaced


def chain_of(liars: AbstractSet[str], exchanged: AbstractSet[tuple[str, str]]) -> dict[str, str]:
    """The peers that frames of one of ``liars`` reached through a round's frame exchanges, directly or through
    peers they reached, each with the liar it is joined to (pure). ``exchanged``: (sender, holder) pairs, each as
    the holder's transcript says (:meth:`PeerAudit.exchanges`); a frame's taint goes from its sender to its holder
    only, so a peer is never joined to a liar by the liar's word: its own transcript must list a frame of the chain.
    In a pipeline every exchange goes both ways (activations down, gradients back), so a liar's whole chain is
    reached. The liars themselves are not in the result."""
    links: dict[str, set[str]] = {}
    for sender, holder in exchanged:
        links.setdefault(sender, set()).add(holder)
    reached: dict[str, str] = {}
    for liar in sorted(liars & links.keys()):
        frontier = [liar]
        while frontier:
            here = frontier.pop()
            for other in sorted(links.get(here, ())):
                if other not in liars and other not in reached:
                    reached[other] = liar
                    frontier.append(other)
    return reached


def disowned(published: tuple[int, str] | None, r: int, expected: Callable[[], str]) -> bool:
    """Whether a stage peer's own checksums say that its phase of round ``r`` started from another state than round
    r - 1's result: ``published`` (the round and checksum of its shard it last published) is of round r - 1 and
    differs from the anchor's (``expected()``, computed only then; SparseLoCo's checksum covers the parameters
    alone). Pure but for ``expected``. A peer whose published checksum is of another round, or absent, proves
    nothing either way. A liar gains nothing by claiming so: its work and its chain's are left out all the same and
    dropped from their error feedback, and it is counted as a withdrawal (:class:`Withdrawals`)."""
    return published is not None and published[0] == r - 1 and published[1] != expected()


def judge(found: PeerAudit, stage: int, liars: AbstractSet[str], off_state: bool = False) -> dict[str, Refusal]:
    """Which contributions of ``found.round`` one stage peer's audit leaves out, and why (pure).

    - its own signed frames convict it: it is banned, and the peers it exchanged frames with are left out; unless
      ``off_state`` (its own checksums said its state was not the anchor, :func:`disowned`): then it and its chain
      are left out, and nobody is banned;
    - it exchanged frames with a peer convicted earlier (``liars``): it is left out;
    - its first step was computed on other weights than the anchor (stale), or its index withdraws its work of
      the round (it knows it trained from a state a resync replaced): it and its chain are left out;
    - nothing of its first step could be checked (it showed none of it, or its neighbours did not): it is left
      out, since work that cannot be checked is not taken (an honest standby switched in after the first step
      loses that round's work);
    - else nothing."""
    r, peer = found.round, found.accused
    guilty = found.guilty
    if guilty is not None and off_state:  # its frames are wrong, but not a lie: its own checksums said so first
        return {p: Refusal(f"round-{r} work of stage {stage} ({peer[:16]}) was computed from a state its own "
                           f"checksums of round {r - 1} disowned", ban=False) for p in (peer, *sorted(found.reached))}
    if guilty is not None:
        result = guilty.result
        out = {peer: Refusal(f"caught lying by a pipeline audit of stage {stage} in round {r}: "
                             f"{result.finding.value} on step {guilty.micro_batch[1]} micro-batch "
                             f"{guilty.micro_batch[2]} {result.detail}".strip(), ban=True)}
        for other in sorted(found.reached):
            out[other] = Refusal(f"its round-{r} work was computed with frames from {peer[:16]}, caught lying",
                                 ban=False)
        return out
    tainted = sorted(found.fed_by & liars)
    if tainted:  # a liar banned earlier that its swarm still routes through
        return {peer: Refusal(f"its round-{r} work was computed with frames from {tainted[0][:16]}, caught lying "
                              "earlier", ban=False)}
    if found.withdrawn:  # honest, its state replaced under the phase, or a liar taking its lie back: not the round's
        return {p: Refusal(f"round-{r} work of stage {stage} ({peer[:16]}) was withdrawn by that peer (it trained "
                           "from a state a resync replaced)", ban=False) for p in (peer, *sorted(found.reached))}
    if found.stale is not None:  # honest, late: its work and its chain's is not the round's
        return {p: Refusal(f"round-{r} work of stage {stage} ({peer[:16]}) was computed on other weights than the "
                           "round's anchor", ban=False) for p in (peer, *sorted(found.reached))}
    if not checked(found):
        return {peer: Refusal(f"none of its round-{r} frames of the phase's first step could be checked",
                              ban=False)}
    return {}


def checked(found: PeerAudit) -> bool:
    """Whether an audit cleared the accused's work of its round: a sample of its phase's first step was recomputed
    and found clean (pure)."""
    return any(v.result.finding is Finding.CLEAN and v.result.inner == 0 for v in found.verdicts)
