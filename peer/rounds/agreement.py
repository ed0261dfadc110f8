"""Which state after a round the replicas agree on, and whether ours is it: pure decisions over checksum records.

A SparseLoCo run agrees bit for bit (:class:`ExactAgreement`: the per-shard majority of exact checksums). The dense
DiLoCo baseline's all-reduce sums in an order that differs between peers, so its replicas agree up to rounding
(:class:`FingerprintAgreement`: a cluster of close fingerprints). The round loop holds one of them and asks it
after every round (verify), at start (is our checkpoint current?) and for a state sync (whom to fetch from).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Protocol

import torch

from hlbp.peer.rounds.rules import fingerprint_cluster, majority_checksums
from hlbp.peer.rounds.statesync import shard_fingerprint
from hlbp.protocol.roundwire import ShardChecks

logger = logging.getLogger(__name__)

Donors = tuple[list[str], dict[str, dict[int, str]]]  # the peers holding the agreed state, and what each holds


class Agreement(Protocol):
    """How a round loop tells the agreed state after a round."""

    member_votes: bool  # whether only a round's members (its accepted set's senders) vote on its state

    def fingerprints(self, anchor: Mapping[str, torch.Tensor],
                     shards: Sequence[Sequence[str]]) -> dict[int, tuple[float, float]]:
        """Fingerprints to publish beside the checksums."""
        ...

    def agreed(self, checks: Sequence[ShardChecks], r: int, held: Sequence[int], n_shards: int,
               whole: AbstractSet[str] = frozenset()) -> Donors | None:
        """The peers holding the agreed state after round r of the ``held`` shards and the checksum to expect
        from each, or None when there is no such state. ``whole``: the voters whose votes rank first
        (:class:`~hlbp.peer.rounds.rules.Votes`)."""
        ...

    def agrees(self, checks: Sequence[ShardChecks], mine: ShardChecks, vote: ShardChecks | None = None,
               whole: AbstractSet[str] = frozenset()) -> bool:
        """Whether our state after ``mine.round`` is the one the others (``checks``) agree on; ``vote``: the part
        of ``mine`` that votes (:func:`~hlbp.peer.rounds.rules.vote_checks`; all of it when None); ``whole``: the
        voters whose votes rank first (ours included when we are one)."""
        ...


class ExactAgreement:
    """Bit-for-bit agreement: per shard, the checksum most of the round's members published for it."""

    member_votes = True

    def fingerprints(self, anchor: Mapping[str, torch.Tensor],
                     shards: Sequence[Sequence[str]]) -> dict[int, tuple[float, float]]:
        return {}

    def agreed(self, checks: Sequence[ShardChecks], r: int, held: Sequence[int], n_shards: int,
               whole: AbstractSet[str] = frozenset()) -> Donors | None:
        want = majority_checksums(checks, r, whole)
        if any(s not in want for s in held):
            return None
        expect = {c.peer: {s: want[s] for s in held if c.checksums.get(s) == want[s]} for c in checks if c.round == r}
        donors = [p for p, shards in expect.items() if shards]  # a donor serves the agreed shards it holds
        return donors, {d: expect[d] for d in donors}

    def agrees(self, checks: Sequence[ShardChecks], mine: ShardChecks, vote: ShardChecks | None = None,
               whole: AbstractSet[str] = frozenset()) -> bool:
        want = majority_checksums([*checks, mine if vote is None else vote], mine.round, whole)
        bad = [s for s in mine.checksums if want.get(s) != mine.checksums[s]]
        if bad:
            logger.warning("round %d: shard checksums %s differ from the majority of %d peers", mine.round, bad,
                           len([c for c in checks if c.round == mine.round]) + 1)
            return False
        return True


class FingerprintAgreement:
    """Agreement up to rounding: the largest cluster of peers whose fingerprints are close (every shard held).
    The dense baseline's all-reduce publishes no accepted set, so every checksum record of the round votes."""

    member_votes = False

    def fingerprints(self, anchor: Mapping[str, torch.Tensor],
                     shards: Sequence[Sequence[str]]) -> dict[int, tuple[float, float]]:
        return {s: shard_fingerprint(dict(anchor), names) for s, names in enumerate(shards)}

    def agreed(self, checks: Sequence[ShardChecks], r: int, held: Sequence[int], n_shards: int,
               whole: AbstractSet[str] = frozenset()) -> Donors | None:
        cluster = [c for c in fingerprint_cluster(checks, r) if len(c.checksums) == n_shards]
        if not cluster:
            return None
        return [c.peer for c in cluster], {c.peer: c.checksums for c in cluster}

    def agrees(self, checks: Sequence[ShardChecks], mine: ShardChecks, vote: ShardChecks | None = None,
               whole: AbstractSet[str] = frozenset()) -> bool:
        cluster = fingerprint_cluster([*checks, mine], mine.round)
        if mine.peer not in {c.peer for c in cluster}:
            logger.warning("round %d: our parameters differ from the %d replicas that agree; reloading state",
                           mine.round, len(cluster))
            return False
        return True
