"""A round's gather set: which contributions a round accepts when more peers contribute than each should download.

With ``F`` (the manifest's ``gather``) a round accepts at most F contributions per shard, so a peer downloads,
decodes and aggregates about F payloads a round whatever the run's size. Which F is a pure rule of public inputs,
so every member recomputes it and a coordinator cannot pick its friends:

* **Standing.** The accepted sets a peer took record, per contributor, the last round it was selected
  (:class:`Standing`). Contributors selected within the last ``memory`` rounds are *veterans*; the rest are
  *newcomers* (new keys, and peers back after a long absence).
* **Priority.** Veterans rotate: one is *due* again once ``cooldown`` rounds passed since its selection (the
  veterans' number over F, so each is due about once in V / F rounds), and due veterans go oldest first (a keyed
  hash of (round, peer) breaks ties). Newcomers take ``newcomer_slots`` places ahead of them (half of F by
  default); the other newcomers come next, before the veterans that are not due. So newcomers get in at least
  that many a round, and also take the places of veterans that left; keys minted by the thousand win those
  places, not the round, and a run that grows faster than that admits its newcomers over a few rounds (their
  pseudo-gradients wait in error feedback meanwhile).
* **Reserves.** The coordinator fetches and checks the first F + R of that order (per shard) and accepts the first
  F that pass: a selected sender whose payload cannot be had or fails a bound is replaced by the next one.
* **Check.** A member refuses an accepted set with more than F members for a shard, a veteran outside the first
  F + R veterans of the order it computes from its own standing and the notices it saw, or more newcomers than
  their places and the reserves (:func:`breach`).
* **Closed runs.** Keys are free, so an open run admits newcomers at ``newcomer_slots`` a round whoever mints
  them; in a run with an allow-list every listed peer counts as a veteran from the start.

What becomes of a contribution the set had no room for is the manifest's ``unselected``. By default it is
dropped, as templar's miners drop what they uploaded whether or not they were gathered: its sender took what it
sent out of its error feedback, and the rest of the buffer stays. Kept instead (``keep``), it goes back into the
buffer whole, as a straggler's does, and is sent, averaged over the phases it waited, when next selected;
``hlbp bench gather`` measured that stale mass 4 % worse at equal tokens than dropping it (F = 8 of 32).

Everything here is pure: the closer (:mod:`hlbp.peer.rounds.closer`) and the in-process engine run it, and
``tests/peer/rounds/test_gather.py`` pins it down.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from enum import Enum
from typing import Any

MAX_STANDING = 1 << 17  # contributors a checkpoint's standing may name


@dataclass(frozen=True)
class GatherRule:
    """The manifest's cap: ``size`` (F) contributions per shard a round accepts (0: every one), ``reserves`` (R)
    more that the coordinator checks to replace selected ones that fail, ``newcomer_share`` of F reserved for
    contributors without standing, and ``memory``: rounds after which a selection no longer gives standing."""

    size: int = 0
    reserves: int = 0
    newcomer_share: float = 0.5
    memory: int = 256

    def __post_init__(self) -> None:
        if self.size < 0 or self.reserves < 0 or self.memory < 1 or not 0.0 <= self.newcomer_share <= 1.0:
            raise ValueError(f"invalid gather rule {self}")

    @property
    def capped(self) -> bool:
        return self.size > 0

    @property
    def newcomer_slots(self) -> int:
        """Places ahead of the veterans that newcomers may take each round (at least one, so a run of veterans
        still admits new peers)."""
        return max(1, math.floor(self.size * self.newcomer_share)) if self.capped else 0


UNCAPPED = GatherRule()


class Standing:
    """The last round each contributor was selected, as the accepted sets this peer took show.

    Every in-sync peer takes the same accepted sets, so peers that recorded the same rounds hold the same standing.
    A peer that missed a round (a restart, a resync, a joiner) holds a shorter record: it is *warm* again once its
    unbroken record reaches back ``memory`` rounds (or to the run's round 0), and only a warm peer refuses sets
    by the order (:func:`breach`); a cold one still refuses a set over the cap.
    """

    def __init__(self, memory: int) -> None:
        self.memory = memory
        self.last: dict[str, int] = {}  # peer -> the last round it was selected
        self.since: int | None = None  # first round of the unbroken record
        self.through = -1  # last round recorded

    def record(self, r: int, members: Iterable[str]) -> None:
        """Round r closed with ``members`` (an empty set too: it keeps the record unbroken)."""
        if r <= self.through:
            return
        if self.since is None or r != self.through + 1:
            self.since = r
        for p in members:
            self.last[p] = r
        self.through = r
        self.last = {p: x for p, x in self.last.items() if x > r - self.memory}

    def to_json(self) -> dict[str, Any]:
        """The record as a checkpoint header keeps it."""
        return {"since": self.since, "through": self.through, "last": dict(self.last)}

    def load_json(self, raw: Any, through: int) -> bool:
        """Take a checkpoint header's record if it is well-formed and ends at round ``through`` (the checkpoint's
        last applied round); otherwise stay cold. The file is as hostile as the network: nothing but small ints
        and short peer ids of a bounded count is taken."""
        self.forget()
        if not isinstance(raw, dict) or raw.get("through") != through or not isinstance(raw.get("last"), dict):
            return False
        since, last = raw.get("since"), raw["last"]

        def ok_int(x: Any) -> bool:
            return isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= through

        if not ok_int(since) or len(last) > MAX_STANDING or not all(
                isinstance(p, str) and len(p) <= 128 and ok_int(x) for p, x in last.items()):
            return False
        self.since, self.through, self.last = since, through, dict(last)
        return True

    def forget(self) -> None:
        """Drop the record (this peer took a set the others did not, and resyncs): cold until it is rebuilt."""
        self.last, self.since, self.through = {}, None, -1

    def warm(self, r: int) -> bool:
        """Whether this record holds every round that gives standing in round r."""
        if r == 0:
            return True
        return self.since is not None and self.through == r - 1 and (self.since == 0 or r - self.since >= self.memory)

    def veterans(self, r: int) -> dict[str, int]:
        """Peer -> the last round it was selected, for those selected within ``memory`` rounds before round r."""
        return {p: x for p, x in self.last.items() if r - self.memory <= x < r}


def _key(r: int, peer: str) -> bytes:
    return hashlib.sha256(f"gather|{r}|{peer}".encode()).digest()


def cooldown(veterans: Mapping[str, int], rule: GatherRule) -> int:
    """Rounds after its selection before a veteran is due again: the veterans' number over F, at least one."""
    return max(1, len(veterans) // max(1, rule.size))


def priority(r: int, candidates: Iterable[str], veterans: Mapping[str, int], rule: GatherRule) -> list[str]:
    """Round r's candidates, best first: ``newcomer_slots`` newcomers (keyed-hash order), the due veterans
    (selected longest ago first), the other newcomers, then the veterans that are not due."""
    pool = set(candidates)
    wait = cooldown(veterans, rule)
    new = sorted((p for p in pool if p not in veterans), key=lambda p: _key(r, p))
    old = sorted((p for p in pool if p in veterans), key=lambda p: (veterans[p], _key(r, p)))
    due = [p for p in old if veterans[p] <= r - wait]
    resting = [p for p in old if veterans[p] > r - wait]
    slots = rule.newcomer_slots
    return new[:slots] + due + new[slots:] + resting


def take(order: Sequence[str], shards_of: Mapping[str, AbstractSet[int]], per_shard: int) -> list[str]:
    """The peers of ``order`` taken in turn, each while every shard it contributes to holds fewer than
    ``per_shard`` of those taken before it; one with a full shard is passed over, so a stage peer of another shard
    further down still gets in. ``per_shard`` of 0: every peer."""
    if per_shard <= 0:
        return list(order)
    count: dict[int, int] = {}
    out = []
    for p in order:
        shards = shards_of[p]
        if shards and all(count.get(s, 0) < per_shard for s in shards):
            out.append(p)
            for s in shards:
                count[s] = count.get(s, 0) + 1
    return out


def candidates(r: int, shards_of: Mapping[str, AbstractSet[int]], veterans: Mapping[str, int],
               rule: GatherRule) -> list[str]:
    """What a coordinator fetches and checks: the first F + R per shard in round r's order (every contributor
    when uncapped)."""
    if not rule.capped:
        return list(shards_of)
    return take(priority(r, shards_of, veterans, rule), shards_of, rule.size + rule.reserves)


def select(r: int, passed: Mapping[str, AbstractSet[int]], veterans: Mapping[str, int],
           rule: GatherRule) -> list[str]:
    """The gather set of round r among the contributions that ``passed`` the coordinator's checks: the first F
    per shard in round r's order (all of them when uncapped)."""
    if not rule.capped:
        return list(passed)
    return take(priority(r, passed, veterans, rule), passed, rule.size)


class BreachKind(Enum):
    OVER_CAP = "over_cap"  # more than F members for a shard
    OUT_OF_ORDER = "out_of_order"  # a veteran member outside the first F + R veterans of the order
    NEWCOMERS = "newcomers"  # more newcomer members than the newcomer places and the reserves allow


@dataclass(frozen=True)
class Breach:
    """How an accepted set breaks the gather rule: ``kind``, and the shard or member that shows it."""

    kind: BreachKind
    shard: int | None = None
    peer: str = ""

    def __str__(self) -> str:
        if self.kind is BreachKind.OVER_CAP:
            return f"it accepts more than the gather size of contributions to shard {self.shard}"
        if self.kind is BreachKind.NEWCOMERS:
            return f"it accepts more newcomers to shard {self.shard} than the newcomer places and reserves allow"
        return f"it accepts {self.peer[:16]}, outside the first gather + reserves veterans of the round's order"


def breach(r: int, members: Mapping[str, AbstractSet[int]], seen: Mapping[str, AbstractSet[int]],
           standing: Standing, rule: GatherRule, veterans: Mapping[str, int] | None = None) -> Breach | None:
    """How round r's accepted set (``members``: peer -> the shards it contributed) breaks the rule, as this peer
    can tell from the notices it saw (``seen``, not banned) and its ``standing``; None when it keeps it.
    ``veterans``: the order's veterans when they are more than the standing shows (a closed run's allowed peers);
    the coordinator must have used the same.

    Over the cap always shows. The order shows only when this peer's standing is warm, and it is checked lane by
    lane, so that notices the coordinator did not see (later arrivals) cannot get an honest set refused:

    * a veteran member must be among the first F + R veterans of the order (a missed notice only pushes the others
      up the coordinator's order, so an honest coordinator breaks this only when more than R plus the newcomer
      places of the better-placed veterans' notices reached this peer and not it);
    * per shard, newcomer members may number the newcomer places (or the places the due veterans seen here leave
      free, when more) plus R; which newcomers is not checked, since whom the coordinator saw decides it.
    """
    if not rule.capped:
        return None
    count: dict[int, int] = {}
    for shards in members.values():
        for s in shards:
            count[s] = count.get(s, 0) + 1
    over = sorted(s for s, n in count.items() if n > rule.size)
    if over:
        return Breach(BreachKind.OVER_CAP, shard=over[0])
    if not standing.warm(r):
        return None
    pool = {**seen, **members}
    veterans = standing.veterans(r) if veterans is None else veterans
    wait = cooldown(veterans, rule)
    old = {p: s for p, s in pool.items() if p in veterans}
    allowed = set(take(priority(r, old, veterans, rule), old, rule.size + rule.reserves))
    outside = sorted(p for p in members if p in veterans and p not in allowed)
    if outside:
        return Breach(BreachKind.OUT_OF_ORDER, peer=outside[0])
    for s in sorted(count):
        due = sum(1 for p, shards in old.items() if s in shards and veterans[p] <= r - wait)
        new = sorted(p for p, shards in members.items() if s in shards and p not in veterans)
        if len(new) > max(rule.newcomer_slots, rule.size - due) + rule.reserves:
            return Breach(BreachKind.NEWCOMERS, shard=s, peer=new[0])
    return None
