"""A round's committee: who hears the contribution notices, who coordinates, and who tells the rest, so that a peer
sends and receives a bounded number of round records whatever the run's size.

All-to-all, every notice and every checksum record reaches every live peer: 2N records a peer and round (2,015
simulated at N = 1000). With a committee of ``size`` (W) the records a round needs are split between its members:

* **Who.** The committee of round r is round r - 2's members, then those of the rounds before it, W seats in all
  (:func:`committee`). Every in-sync peer took the same accepted sets, so every one computes the same committee,
  and being quick to announce buys no seat. Two rounds back, because round r's notices go out before round r - 1
  has closed everywhere (an overlapped exchange runs during the next inner phase).
* **Leads.** Its first ``leads`` members coordinate in turn, as before. They hold no notices of their own.
* **Holders.** Each contributor sends its notice to one committee member (:func:`holder`, rendezvous hashing of
  (round, sender) over the members after the leads), so a holder hears about N / (W - leads) notices. A holder
  forwards to the leads, in one message, the notices of its part that the gather rule could select
  (:func:`forwarded`): the first F + R per shard. Restricting the rule's order to a part keeps the order of what
  remains, so the round's first F + R are among the parts' first F + R (exactly so when the contributors hold the
  same shards: full replicas; a mix of stage peers may lose a deep-ranked stage contribution). A lead hears
  W - leads forwards instead of N notices. A holder whose announcement expired (it died) is not waited for, and
  the senders it would hold send to the leads as well (:func:`gone`, :func:`notice_to`).
* **Relays.** The coordinator sends the accepted set, with its members' notices, to the committee; each holder
  relays it to the senders of the notices it holds. A peer hears the set once, from its holder.
* **Checks.** After round r each peer reads the checksum records of ``samples`` seats of round r + 1's committee
  (:func:`check_sample`: peers with standing, which applied round r), instead of every member's.

The DHT stays the record of truth and the fallback: every record is still stored there, and a peer whose holder
left reads the round's accepted sets (a few records) from it. Everything here is pure: the closer and the protocol
simulator run it, and ``tests/peer/rounds/test_committee.py`` pins it down.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from hlbp.peer.rounds.gather import GatherRule, priority
from hlbp.protocol.manifest import MAX_COMMITTEE


@dataclass(frozen=True)
class CommitteeRule:
    """The manifest's committee: ``size`` (W) seats (0: none, records go all-to-all), the first ``leads`` of
    which coordinate and hold no notices, and ``samples`` members whose checksums a peer reads after a round."""

    size: int = 0
    leads: int = 3
    samples: int = 4

    def __post_init__(self) -> None:
        if not 0 <= self.size <= MAX_COMMITTEE or self.leads < 1 or self.samples < 1:
            raise ValueError(f"a committee has 0 to {MAX_COMMITTEE} seats, at least one lead and one sample; "
                             f"got {self.size}, {self.leads} and {self.samples}")

    @property
    def on(self) -> bool:
        return self.size > 0


def _rank(*parts: object) -> bytes:
    return hashlib.sha256(("committee|" + "|".join(str(p) for p in parts)).encode()).digest()


LOOKBACK = 64  # rounds a committee may reach back to fill its seats


def committee(r: int, rounds: Sequence[Iterable[str]], rule: CommitteeRule) -> tuple[str, ...]:
    """Round r's committee from the members of earlier rounds (``rounds``: round r - 2's first, then the rounds
    before it, at most ``LOOKBACK``): each round's members in rendezvous order of (r, peer), newest round first,
    until W seats are filled. A gather set of F takes F members a round, so W seats reach back about W / F rounds.
    Empty when the rule is off or round r - 2 had no members (records go all-to-all then)."""
    if not rule.on or not rounds or not rounds[0]:
        return ()
    seats: list[str] = []
    for members in rounds[:LOOKBACK]:
        for p in sorted(set(members) - set(seats), key=lambda p: _rank("seat", r, p)):
            if len(seats) == rule.size:
                return tuple(seats)
            seats.append(p)
    return tuple(seats)


def order_checked(r: int, rule: CommitteeRule) -> bool:
    """Whether a peer checks round r's accepted set against the gather rule's order of the notices it saw, or only
    against the cap. With a committee, from round 2 on, no two peers see the same notices (a holder its part, a
    lead the forwards, a peer whose holder died every notice read from the DHT): judged against what each saw, an
    honest set was refused by some peers and taken by the rest, a split (measured with a holder killed). The cap
    is judged alike by every peer; the order is then the leads' to keep, and they rotate every round."""
    return not rule.on or r < 2


def leads(seats: Sequence[str], rule: CommitteeRule) -> tuple[str, ...]:
    """The committee members that coordinate in turn and receive the holders' forwards."""
    return tuple(seats[:rule.leads])


def holders(seats: Sequence[str], rule: CommitteeRule) -> tuple[str, ...]:
    """The seats that hold parts of the notices: those after the leads (the leads when there are no others)."""
    return tuple(seats[rule.leads:]) or tuple(seats)


def holder(r: int, sender: str, seats: Sequence[str], rule: CommitteeRule) -> str:
    """The committee member that holds ``sender``'s notice of round r: by rendezvous hashing over the members after
    the leads (over the leads when there are no others). ``seats`` must not be empty."""
    return min(holders(seats, rule), key=lambda c: _rank(r, sender, c))


def part_of(r: int, h: str, seats: Sequence[str], rule: CommitteeRule, senders: AbstractSet[str]) -> set[str]:
    """Of ``senders``, those whose notices of round r holder ``h`` holds."""
    return {p for p in senders if holder(r, p, seats, rule) == h}


def part_complete(r: int, h: str, seats: Sequence[str], rule: CommitteeRule, senders: AbstractSet[str],
                  expected: AbstractSet[str] | None) -> bool:
    """Whether every ``expected`` contributor (the announced ones; None: not known) whose notice of round r holder
    ``h`` holds is among ``senders``."""
    return expected is not None and part_of(r, h, seats, rule, set(expected)) <= set(senders)


def parts_in(r: int, me: str, seats: Sequence[str], rule: CommitteeRule, told: AbstractSet[str],
             senders: AbstractSet[str], expected: AbstractSet[str] | None,
             away: AbstractSet[str] = frozenset()) -> bool:
    """Whether a lead (``me``) has every part of round r's notices: each holder told it its part is complete
    (``told``), and its own part (when it holds one) and the part of each holder ``away`` (:func:`gone`: nobody
    will tell for it, and its senders send to the leads as well) are complete among ``senders``, the notices it
    has (:func:`part_complete`)."""
    pool = holders(seats, rule)
    return (set(pool) - {me} - set(away) <= set(told)
            and all(part_complete(r, h, seats, rule, senders, expected)
                    for h in ([me] if me in pool else []) + sorted(away)))


def gone(seats: Sequence[str], rule: CommitteeRule, online: AbstractSet[str] | None) -> frozenset[str]:
    """The holders no longer announced online (``online``: the peers the run's announcements name as contributors,
    as last read; None: not known, and no holder counts as gone).

    A committee is drawn from the members of past rounds, so it can seat a peer that has since died: one killed
    mid-run keeps its seats for the two or three rounds its membership reaches, its part of the notices never
    reaches the leads, and each of those rounds would wait out its window and the leads' ask for the parts. Once
    its announcement has expired the leads stop waiting for its part and its senders send their notices to the
    leads as well (:func:`notice_to`). Only timing rides on this: the accepted
    set is still the coordinator's signed one, applied alike by everyone; a partial read of the announcements only
    closes a round earlier, as an unread contributor does without a committee."""
    if online is None:
        return frozenset()
    return frozenset(h for h in holders(seats, rule) if h not in online)


def notice_to(r: int, sender: str, seats: Sequence[str], rule: CommitteeRule,
              online: AbstractSet[str] | None) -> set[str]:
    """Whom ``sender`` sends its notice of round r: its :func:`holder`, and the leads too when that holder is
    :func:`gone` (its part would never be forwarded). Still to the holder: a peer off the committee reads the
    announcements only every few rounds, so a holder that joined since may look gone, and a live holder whose part
    lacks an expected notice holds its leads to the window."""
    h = holder(r, sender, seats, rule)
    return {h, *leads(seats, rule)} if h in gone(seats, rule, online) else {h}


def forwarded(r: int, part: Mapping[str, AbstractSet[int]], veterans: Mapping[str, int],
              gather: GatherRule) -> list[str]:
    """Which of the notices a holder holds (``part``: sender -> its shards) it forwards to the leads: per shard,
    the first F + R of the gather rule's order among the part's contributors to that shard (every one when the
    run is uncapped), in that order."""
    if not gather.capped:
        return sorted(part)
    order = priority(r, part, veterans, gather)
    keep: set[str] = set()
    for s in sorted({s for shards in part.values() for s in shards}):
        keep.update([p for p in order if s in part[p]][:gather.size + gather.reserves])
    return [p for p in order if p in keep]


def relayed_to(r: int, me: str, seats: Sequence[str], held: AbstractSet[str], rule: CommitteeRule) -> set[str]:
    """Whom a committee member sends round r's accepted set on to: the senders of the notices it holds (those
    whose :func:`holder` it is), not itself."""
    return {p for p in held if p != me and holder(r, p, seats, rule) == me}


def check_sample(r: int, me: str, readable: Sequence[str], rule: CommitteeRule) -> list[str]:
    """Whose checksum records of round r a peer reads: ``samples`` of ``readable`` (the next round's committee:
    peers with standing, which applied round r), not itself, the first in order of a keyed hash of (round, reader,
    seat), so each seat is read by about N * samples / W peers."""
    others = sorted((m for m in set(readable) if m != me), key=lambda m: _rank("checks", r, me, m))
    return others[:rule.samples]
