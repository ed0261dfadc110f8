"""Flagging copied contributions: a peer that sends another's indices, or an earlier round's tensors again.

A free-rider can pass verification without training: copy another replica's payload of the same round (it is
served openly for gossip), or resend its own or anyone's tensors of an earlier round in a fresh envelope. Both are
well-formed and signed, so the codec cannot refuse them. This module measures the evidence; the round reports it
(``RoundStats.copies``, the metrics log) instead of banning, because honest replicas do share indices (they start
each round from the same parameters), and the measured honest overlap (README, "Hostile peers") sets the
threshold well above it.

Pure functions of decoded contributions; every in-sync peer computes the same flags from the same accepted set.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from itertools import combinations

import numpy as np

from hlbp.peer.rounds.outer import Contribution
from hlbp.protocol.sparse import SparseTensor

OVERLAP_THRESHOLD = 0.9  # fraction of one contribution's positions also selected by another: flagged above this


def positions(c: Contribution) -> dict[str, np.ndarray]:
    """Each sparse tensor's selected flat positions, sorted (dense tensors select everything and are skipped)."""
    return {n: np.sort(t.flat_indices().numpy()) for n, t in c.tensors.items() if isinstance(t, SparseTensor)}


def overlap(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> float:
    """|A ∩ B| / min(|A|, |B|) over all tensors: 1.0 when one contribution's positions are inside the other's."""
    shared = total_a = total_b = 0
    for name, pa in a.items():
        pb = b.get(name)
        total_a += pa.size
        if pb is None:
            continue
        total_b += pb.size
        shared += int(np.intersect1d(pa, pb, assume_unique=True).size)
    smaller = min(total_a, total_b)
    return shared / smaller if smaller else 0.0


def fingerprint(c: Contribution) -> str:
    """A digest of a contribution's tensors alone (positions, codes, table, shift, values), without its envelope:
    the same tensors resent under a new round, sender or token count give the same fingerprint."""
    h = hashlib.sha256()
    for name in sorted(c.tensors):
        t = c.tensors[name]
        h.update(name.encode())
        if isinstance(t, SparseTensor):
            for part in (t.indices, t.codes, t.table, t.values):
                if part is not None:
                    h.update(part.contiguous().numpy().tobytes())
            h.update(np.float32(t.shift).tobytes())
        else:
            h.update(t.contiguous().float().numpy().tobytes())
    return h.hexdigest()


def overlapping_pairs(contributions: Sequence[Contribution], threshold: float = OVERLAP_THRESHOLD
                      ) -> tuple[list[tuple[str, str, float]], float]:
    """Sender pairs whose positions overlap above ``threshold`` (sorted), and the largest overlap of any pair."""
    pos = {c.sender: positions(c) for c in contributions}
    flagged, largest = [], 0.0
    for a, b in combinations(sorted(pos), 2):
        value = overlap(pos[a], pos[b])
        largest = max(largest, value)
        if value > threshold:
            flagged.append((a, b, round(value, 4)))
    return flagged, largest


class ReuseLog:
    """Fingerprints of the contributions of the last ``window`` rounds, to spot tensors sent again."""

    def __init__(self, window: int = 8) -> None:
        self.window = window
        self._seen: dict[str, tuple[int, str]] = {}  # fingerprint -> (round, sender) of its first appearance

    def check(self, round_: int, contributions: Sequence[Contribution]) -> list[tuple[str, int, str]]:
        """(sender, earlier round, earlier sender) for each contribution of ``round_`` whose tensors appeared
        before (in an earlier round, or from another sender of this round); then remembers this round's."""
        self._seen = {d: v for d, v in self._seen.items() if v[0] > round_ - self.window}
        found = []
        for c in sorted(contributions, key=lambda c: c.sender):
            digest = fingerprint(c)
            first = self._seen.get(digest)
            if first is not None and first != (round_, c.sender):
                found.append((c.sender, first[0], first[1]))
            else:
                self._seen[digest] = (round_, c.sender)
        return found
