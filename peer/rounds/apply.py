"""Applying a round's accepted set: fetch every accepted payload, bound it, aggregate it into the anchor, and refuse
the whole round when it breaks a bound of :mod:`hlbp.peer.rounds.guard`.

Every in-sync peer holds the same accepted bytes and the same anchor, so every one reaches the same
:mod:`~hlbp.peer.rounds.outcome` and bans the same senders; only a payload this peer alone could not fetch makes its
outcome differ (:class:`~hlbp.peer.rounds.outcome.Failed`, and it resyncs).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from hlbp.peer.net.transport import TransportError
from hlbp.peer.rounds import copies, guard, spread
from hlbp.peer.rounds.bans import RoundBans
from hlbp.peer.rounds.config import RoundConfig
from hlbp.peer.rounds.outcome import Applied, Failed, Refused, RoundOutcome
from hlbp.peer.rounds.outer import Contribution
from hlbp.peer.rounds.overlap import Subset
from hlbp.peer.rounds.payloads import BadPayload, Payloads, error_text
from hlbp.peer.rounds.state import ReplicaState
from hlbp.protocol import ProtocolError
from hlbp.protocol.roundwire import AcceptedSet

logger = logging.getLogger(__name__)


class Applier:
    """Applies the accepted sets of one round loop to its :class:`~hlbp.peer.rounds.state.ReplicaState`.

    ``applied``: the shards whose accepted contributions we apply (held and followed); ``held``: those we vouch
    for (copies are looked for there). ``loss_of(r, params)``: the loss of ``params`` (round r's anchor or candidate
    result) on the run's fixed guard batch (None: no loss guard; it returning None: not known this round, so the norm
    bounds alone judge it). A peer that holds some shards only (a stage peer) asks for its candidate's, scored by its
    swarm, in rounds without a full replica only. ``on_restore()``: called when a refused round's parameters were put back (reload the model)."""

    def __init__(self, me: str, cfg: RoundConfig, shards: Sequence[Sequence[str]], held: Sequence[int],
                 applied: Sequence[int], payloads: Payloads, bans: RoundBans,
                 loss_of: Callable[[int, Mapping[str, torch.Tensor]], float | None] | None, on_restore: Callable[[], None]) -> None:
        self.me, self.cfg, self.shards, self.held, self.applied = me, cfg, shards, held, applied
        self.payloads, self.bans, self.loss_of, self.on_restore = payloads, bans, loss_of, on_restore
        self.guard = cfg.guard
        self.last_ratios: dict[str, float] = {}  # the last applied round's largest norm ratios (guard)
        self.last_copies: list[dict[str, Any]] = []  # the last applied round's evidence of copied contributions
        self._reuse = {s: copies.ReuseLog() for s in held}

    def apply(self, r: int, accepted: AcceptedSet, state: ReplicaState,
              online: Mapping[str, AbstractSet[int]] | None = None) -> RoundOutcome:
        """Fetch, verify, bound and apply the accepted set of round r: :class:`Applied`, :class:`Refused` (nobody's
        parameters move, the offenders are banned) or :class:`Failed` (this peer alone is out of sync).
        ``online``: the peers last read announced online -> the shards each applies (empty: not known)."""
        # each held (or followed) shard takes the members that contributed to it (a stage peer contributes its own
        # shard only)
        jobs = [(sender, s, digests[s]) for sender, _tokens, digests in accepted.members for s in self.applied
                if s in digests]
        # each payload's fetch tree spans the peers announced online (as last read) that apply its shard (a stage
        # peer asked for another stage's payload never fetches it), under the round's members; when they are not
        # known, the peers with standing (selected within its memory: long-lived peers)
        veterans = sorted(state.standing.veterans(r))
        population = {s: sorted(p for p, held in online.items() if s in held) if online else veterans
                      for s in self.applied}

        def get(job: tuple[str, int, str]) -> tuple[str, int, Contribution | BadPayload | None]:
            sender, s, digest = job
            self.payloads.await_prefetch(r, sender)
            cached = self.payloads.take(r, sender, s, digest)
            if cached is not None:
                return sender, s, cached
            try:
                members = [p for p, _t, d in accepted.members if s in d]
                chain = spread.sources(r, sender, self.me, population[s], shard=s, members=members)
                return sender, s, self.payloads.decode(r, s, sender, digest, chain, accepted.coordinator)
            except BadPayload as exc:
                return sender, s, exc
            except (TransportError, ProtocolError) as exc:
                if s in self.held:
                    raise
                logger.warning("round %d: could not fetch the contribution of %s to followed shard %d (%s); that "
                               "shard waits for its holders' state", r, sender[:16], s, error_text(exc))
                return sender, s, None

        try:
            with ThreadPoolExecutor(self.cfg.fetch_workers) as pool:
                got = list(pool.map(get, jobs))
        except (TransportError, ProtocolError) as exc:
            logger.warning("round %d: could not obtain an accepted contribution (%s)", r, error_text(exc))
            return Failed(error_text(exc))
        bad = {sender: str(c) for sender, _s, c in got if isinstance(c, BadPayload)}
        if bad:
            return self._refuse(r, bad, "an accepted contribution does not decode")
        missing = {s for _sender, s, c in got if c is None}  # followed shards only: they are fetched whole later
        per_shard: dict[int, list[Contribution]] = {s: [] for s in self.applied if s not in missing}
        for _sender, s, c in sorted(got, key=lambda g: (g[1], g[0])):
            if s in per_shard:
                per_shard[s].append(c)  # type: ignore[arg-type]
        plan = guard.loss_check(len(self.held), len(self.shards), [len(d) for _p, _t, d in accepted.members],
                                bool(state.guard_losses))
        loss_of = self.loss_of if plan.score and per_shard else None
        base = loss_of(r, state.anchor) if loss_of is not None and plan.anchor else None
        # each parameter is replaced as soon as its new value is made (the old tensor goes at once: no second anchor
        # at the round's peak); a refused round puts back what it wrote since this snapshot (rounds/anchor.py)
        before = state.anchor.snapshot()
        ratios = {"contribution": 0.0, "update": 0.0}  # the largest of the round, reported to measure the bounds
        for s, contributions in per_shard.items():
            names = self.shards[s]
            norms = {c.sender: guard.contribution_norm(c) for c in contributions}
            ratios["contribution"] = max([ratios["contribution"], *(n / self.payloads.scales[s] for n in norms.values())])
            over = guard.oversized(norms, self.payloads.scales[s], self.guard)
            if over:
                return self._refuse(r, {p: f"shard {s}'s contribution norm is {v:.3g}x the shard's parameter norm"
                                        for p, v in over.items()}, "a contribution breaks the norm bound")
            far = guard.outliers(norms, self.guard)
            if far:  # the coordinator drops these before it accepts: only a lying one lets one through
                return self._refuse(r, {p: f"shard {s}'s contribution norm is {v:.3g}x the round's median"
                                        for p, v in far.items()}, "a contribution is far above the round's others")
            shard = Subset(state.anchor, list(names))
            scale = guard.scale(state.anchor, names)
            moved = 0.0  # ‖θ_s(t+1) − θ_s(t)‖², a parameter at a time
            steps = state.outers[s].sparse_steps(list(names), contributions)
            if steps is not None:
                # a sparse step changes each parameter at a few positions: read and written there (a block of a
                # spilled parameter at a time), with no copy of the parameter, old or new, while training runs
                for n, step in steps:
                    old_at = state.anchor.values_at(n, step.positions)
                    new_at = step.new_values(old_at)
                    moved += guard.squared_change(new_at, old_at)  # elsewhere unchanged: 0 there
                    state.anchor.put_at(n, step.positions, new_at, old_at)
                    del old_at, new_at
            else:
                for n, value in state.outers[s].applying(shard, contributions):
                    old = state.anchor[n]
                    moved += guard.squared_change(value, old)
                    state.anchor.put(n, value, old)
                    del value, old  # one parameter's tensors at a time: gone before the next one's are made
            ratio = guard.ratio_of(moved, scale)
            ratios["update"] = max(ratios["update"], ratio)
            self.last_ratios = ratios
            reason = guard.refuse_reason(ratio, self.guard)
            if reason:
                state.anchor.restore(before)
                blamed = guard.culprits(norms)
                return self._refuse(r, {p: f"largest contribution to shard {s}" for p in blamed},
                                    f"shard {s}: {reason}")
        loss = loss_of(r, state.anchor) if loss_of is not None else None
        if loss is not None:
            ratios["loss"] = loss  # reported with the ratios: the guard batch's loss of the round's result
            if base is not None:
                ratios["anchor_loss"] = base
            self.last_ratios = ratios
            recent = [*state.guard_losses, base] if base is not None else state.guard_losses
            reason = guard.loss_reason(recent, loss, self.guard)
            if reason:
                state.anchor.restore(before)
                self.on_restore()
                norms = {c.sender: guard.contribution_norm(c) for cs in per_shard.values() for c in cs}
                return self._refuse(r, {p: "largest contribution of a round whose loss exploded"
                                        for p in guard.culprits(norms)} if plan.blame else {}, reason)
            state.guard_losses = [*state.guard_losses[-guard.LOSS_WINDOW + 1:], loss]
        self.last_copies = self._copies(r, {s: per_shard[s] for s in self.held})
        return Applied()

    def _copies(self, r: int, per_shard: dict[int, list[Contribution]]) -> list[dict[str, Any]]:
        """Evidence of copied contributions in an applied round (reported, not punished: see rounds/copies.py)."""
        found: list[dict[str, Any]] = []
        largest = 0.0
        for s, contributions in per_shard.items():
            pairs, top = copies.overlapping_pairs(contributions)
            largest = max(largest, top)
            found += [{"kind": "overlap", "shard": s, "peers": [a, b], "overlap": v} for a, b, v in pairs]
            found += [{"kind": "reuse", "shard": s, "peer": p, "first_round": fr, "first_peer": fp}
                      for p, fr, fp in self._reuse[s].check(r, contributions)]
        self.last_ratios["overlap"] = largest
        for item in found:
            logger.warning("round %d: possible copy: %s", r, item)
        return found

    def _refuse(self, r: int, offenders: dict[str, str], why: str) -> Refused:
        """Refuse round r as a whole (nobody's parameters move) and ban ``offenders`` (sender -> reason)."""
        logger.warning("round %d: refused (%s); keeping the parameters of round %d", r, why, r - 1)
        for sender, reason in sorted(offenders.items()):
            self.bans.ban_by_guard(r, sender, reason)
        return Refused(why, dict(offenders))
