"""The round protocol's decisions as pure functions: who coordinates, how long a window is, which accepted set
wins, what the majority holds, and how big a payload may be.

Every peer computes them from the same DHT records, so they must be deterministic; they touch no network and no
clock, which is also what lets ``tests/peer/rounds/test_rules.py`` pin them down exactly.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace
from enum import Enum

from hlbp.protocol.roundwire import AcceptedSet, ShardChecks


@dataclass(frozen=True)
class Expected:
    """The contributors a round can expect, as the run's announcements name them: ``count`` of them (0: the
    announcements could not be read), who (``peers``; None where only a count is known, as in the in-process
    engine) and which shards each applies (``shards``). A round is complete, and may close before its window
    ends, once these have announced."""

    count: int
    peers: frozenset[str] | None = None
    # the shards each of ``peers`` applies (a full replica every one, a stage peer its stage's); None: not known
    shards: Mapping[str, frozenset[int]] | None = None
    # the ``count`` expected contributions, each as the peers any one of whom sends it: a full replica alone, or
    # every peer announcing one stage of one whole swarm (its standby among them); None: not known
    slots: tuple[frozenset[str], ...] | None = None


UNKNOWN = Expected(0)  # the announcements could not be read: no round is complete before its window ends


def complete(senders: AbstractSet[str] | Mapping[str, object], expected: Expected,
             banned: Callable[[str], bool] = lambda p: False) -> bool:
    """Whether every expected contributor has announced a contribution: the ``senders`` of the round's notices that
    are expected (named in ``expected.peers``, when it names them) and not ``banned`` number ``expected.count``, less
    the expected contributions only banned peers could send (their contributions would be refused: waiting for them
    only stretched every round to its window once three attackers were banned). Where the slots are known, a banned
    stage peer whose stage another peer of its swarm serves takes nothing off: without the slots, a banned liar and
    the standby that replaced it counted as two, and rounds closed as complete before the swarm's driver, which
    sends its contribution last, had announced it.

    Notices from anyone else never make a round complete: 40 notices under throwaway keys made every round
    "complete" at its first notice, and the coordinator closed it on its own contribution, leaving out honest ones a
    second later."""
    if expected.count <= 0:
        return False
    if expected.slots is not None:
        need = expected.count - sum(1 for slot in expected.slots if slot and all(banned(p) for p in slot))
    elif expected.peers is not None:
        need = expected.count - sum(1 for p in expected.peers if banned(p))
    else:
        need = expected.count
    named = [p for p in senders if (expected.peers is None or p in expected.peers) and not banned(p)]
    return len(named) >= max(need, 1)


def coordinator_order(round_: int, peers: Sequence[str]) -> list[str]:
    """Rendezvous ranking of ``peers`` for a round: every peer computes the same order from the same set."""
    return sorted(set(peers), key=lambda p: hashlib.sha256(f"{round_}|{p}".encode()).digest())


def coordinator_ranking(round_: int, shards_of: Mapping[str, AbstractSet[int]], n_shards: int,
                        undialable: AbstractSet[str] = frozenset()) -> list[str]:
    """The coordinator order of a round whose contributors hold different shards (``shards_of``: peer -> the
    shards its notice names): peers that contributed every shard first, then the others. A full replica holds every
    shard's anchor, so it can bound every contribution before accepting it; a stage peer coordinates only when no
    full replica contributed.

    Within each group, the ``undialable`` (their notices say nobody can dial them: behind NAT) come after the
    others, each part in rendezvous order: a coordinator behind NAT cannot fetch the payload of another peer behind
    NAT (neither can dial the other), so it would leave that contribution out, where a dialable one gets it over the
    connection the NATed sender opened to it."""
    full = [p for p, held in shards_of.items() if len(held) == n_shards]
    partial = [p for p in shards_of if p not in set(full)]
    order: list[str] = []
    for group in (full, partial):
        order += coordinator_order(round_, [p for p in group if p not in undialable])
        order += coordinator_order(round_, [p for p in group if p in undialable])
    return order


def turn_order(round_: int, prior: Mapping[str, AbstractSet[int]], notices: Mapping[str, AbstractSet[int]],
               n_shards: int, undialable: AbstractSet[str] = frozenset(),
               announced: AbstractSet[str] | None = None) -> list[str]:
    """Whose turn it is to close round ``round_``, best first: the members of the previous round (``prior``: peer ->
    the shards it contributed, as the accepted set every peer applied says) in :func:`coordinator_ranking`, then the
    other contributors seen (``notices``) the same way.

    The first part is agreed before the round opens, so being quick to announce buys no place in it: a key that was
    not a member last round (new, throwaway, or left out) ranks behind every member, whether or not that member has
    announced yet. A member that died costs its successors one takeover delay, for one round only (it is no member
    of a round it missed). ``undialable``: peers behind NAT, each part ranks them last (:func:`coordinator_ranking`).

    Among the others, the peers the run's announcements name as contributors (``announced``, when known) come before
    keys nobody announced. Without a previous round (the run's first, or after every member left) that is the
    whole order: 40 notices under unannounced keys, seen by some peers a moment before others, put the honest
    coordinator 9 places down for some and first for others, and the two halves of the run took the same set 35 s
    apart, and split."""
    first = coordinator_ranking(round_, prior, n_shards, undialable)
    rest = {p: s for p, s in notices.items() if p not in prior}
    if announced is None:
        return first + coordinator_ranking(round_, rest, n_shards, undialable)
    named = coordinator_ranking(round_, {p: s for p, s in rest.items() if p in announced}, n_shards, undialable)
    others = coordinator_ranking(round_, {p: s for p, s in rest.items() if p not in announced}, n_shards, undialable)
    return first + named + others


HOLD_UP_SHARE = 0.5  # of the collection window: how long the others' notices wait for the head of the order's phase


def holds_up(me: str, r: int, prior: Mapping[str, AbstractSet[int]], n_shards: int, undialable: AbstractSet[str],
             lead: Sequence[str], first_seen: float | None, now: float, window: float) -> bool:
    """Whether peer ``me``, still in its inner phase of round ``r``, holds the round up: it comes first in the turn
    order agreed before the round (the committee's first lead, else the head of :func:`coordinator_ranking` over the
    previous round's members, ``prior``), so every other peer waits for its close, and the first notice of another
    of those members came at least ``HOLD_UP_SHARE`` of the collection window ago (``first_seen``, None: none yet).

    Such a peer ends its phase and contributes the steps it made (:class:`hlbp.peer.rounds.phase.InnerPhase`):
    a slow head of the order is otherwise waited for until the next in turn takes over, a window and a takeover
    delay after the first notice. A peer later in the order holds nothing up: the round closes without it."""
    if first_seen is None or now < first_seen + HOLD_UP_SHARE * window:
        return False
    if lead:
        return lead[0] == me
    order = coordinator_ranking(r, prior, n_shards, undialable)
    return bool(order) and order[0] == me


def set_counts(s: AcceptedSet, order: Sequence[str], *, prior_known: bool, complete: bool, first_seen: float | None,
               now: float, window: float, max_window: float, takeover_s: float, min_contributors: int) -> bool:
    """Whether an accepted set published so far counts now, by the turn rule: a set is taken only from a peer whose
    turn has come, as this peer's own clock sees it.

    The first in ``order`` may close at once when the order was agreed before the round (``prior_known``) or every
    expected contributor has announced (``complete``); otherwise, and for the k-th in ``order``, once the window
    after the first notice (``first_seen``) and k takeover delays have passed here, which is when an honest k-th
    coordinator publishes. A set without members counts only after the manifest's longest window (an honest
    coordinator publishes one only then), so an empty set never displaces contributions announced in time; one with
    fewer members than the run requires never counts. A publisher outside ``order`` (it contributed nothing and was
    no member) never closes a round."""
    if s.coordinator not in order:
        return False
    k = order.index(s.coordinator)
    if not s.members:
        return first_seen is not None and now >= first_seen + max_window + k * takeover_s
    if len(s.members) < min_contributors:
        return False
    if k == 0 and (prior_known or complete):
        return True
    return first_seen is not None and now >= first_seen + window + k * takeover_s


WINDOW_SHRINK = 0.75  # a window shrinks by at most a quarter a round


def adapt_window(offsets: Sequence[float], lo: float, hi: float, current: float) -> float:
    """Next round's collection window from this round's arrival offsets (seconds after the first arrival).

    1.5x the latest on-time arrival plus one second, within the manifest's bounds. It grows at once but shrinks by
    at most a quarter a round: a few rounds in lockstep would otherwise take it to the floor in one step, and the
    first hiccup of an honest peer on a busy machine (a garbage collection, a slow store) then left it out. The
    window costs nothing while everybody is on time (the coordinator closes once every expected contribution is
    in); it is waited out only for a member that is missing. With no spread observed the window keeps its value,
    so a single peer does not shrink it.
    """
    if len(offsets) < 2:
        return min(max(current, lo), hi)
    return min(max(1.5 * max(offsets) + 1.0, WINDOW_SHRINK * current, lo), hi)


def widen_for_late(current: float, closed_window: float, late: Sequence[float], hi: float) -> float:
    """The window after contributions of a closed round landed ``late`` (seconds after that round's first
    arrival), when it was ``closed_window`` long.

    A peer that missed the close by less than one more window (offset within twice the window: one catching up
    after a restart, or a moment slower than the others) widens the next window to take it, as if it had been on
    time; a later one is a straggler, and a straggler is left out, never waited for. A lying peer gains nothing
    from this that arriving at the end of a window does not already give it: both are bounded by ``hi``.
    """
    near = [t for t in late if 0.0 <= t <= 2.0 * closed_window]
    if not near:
        return current
    return max(current, min(1.5 * max(near) + 1.0, hi))


def pick_accepted(sets: Sequence[AcceptedSet], order: Sequence[str]) -> AcceptedSet | None:
    """The accepted set of the best-ranked coordinator among those that published one."""
    rank = {p: i for i, p in enumerate(order)}
    ranked = [s for s in sets if s.coordinator in rank]
    if not ranked:
        # a coordinator outside the contributors we saw (we saw few): fall back to a deterministic choice
        return min(sets, key=lambda s: s.coordinator) if sets else None
    return min(ranked, key=lambda s: rank[s.coordinator])


def round_set(round_: int, notices: Mapping[str, AbstractSet[int]], sets: Sequence[AcceptedSet], n_shards: int,
              undialable: AbstractSet[str] = frozenset(), first: Sequence[str] = ()) -> AcceptedSet | None:
    """The accepted set of round ``round_`` as its records show it: the set of the best-ranked coordinator among
    the contributors (``notices``: sender -> the shards its notice names), ``first`` (a committee's leads, who
    coordinate before the rest) ranked ahead; None when no contributor published one. A set from a key that
    contributed nothing never counts. ``undialable``: the senders whose notices say they cannot be dialled
    (:func:`coordinator_ranking`)."""
    ranking = coordinator_ranking(round_, notices, n_shards, undialable)
    order = [p for p in first if p in notices] + [p for p in ranking if p not in set(first)]
    return pick_accepted([s for s in sets if s.coordinator in order], order)


def round_members(round_: int, notices: Mapping[str, AbstractSet[int]], sets: Sequence[AcceptedSet],
                  n_shards: int, undialable: AbstractSet[str] = frozenset()) -> frozenset[str] | None:
    """The members of round ``round_`` as its records show them (:func:`round_set`), or None."""
    accepted = round_set(round_, notices, sets, n_shards, undialable)
    return None if accepted is None else frozenset(accepted.senders())


def round_member_shards(round_: int, notices: Mapping[str, AbstractSet[int]], sets: Sequence[AcceptedSet],
                        n_shards: int, undialable: AbstractSet[str] = frozenset()) -> dict[str, frozenset[int]] | None:
    """The members of round ``round_`` and the shards each contributed, as its accepted set lists them (the set,
    not the notices: a reader may lack some notices), or None."""
    accepted = round_set(round_, notices, sets, n_shards, undialable)
    return None if accepted is None else {s: frozenset(d) for s, _, d in accepted.members}


def behind_members(members: AbstractSet[str], checks: Sequence[ShardChecks], round_: int, me: str) -> set[str]:
    """The members of round ``round_`` other than ``me`` whose latest checksum record (``checks``: each peer's
    latest) is of an earlier round, or who have none."""
    latest = {c.peer: c.round for c in checks}
    return {p for p in members if p != me and latest.get(p, -1) < round_}


def result_unpublished(members: AbstractSet[str], checks: Sequence[ShardChecks], round_: int, me: str) -> bool:
    """Whether round ``round_`` closed with members other than ``me`` (``members``: its accepted set's senders) and
    none of them has published a state of that round or a later one (``checks``: each peer's latest record): its
    result then exists only in the members' memory or checkpoints, as when a swarm stopped right after the round
    closed comes back."""
    others = set(members) - {me}
    return bool(others) and behind_members(others, checks, round_, me) == others


def result_pending(next_round: int, latest_agreed: int, closing: AbstractSet[str], me: str) -> bool:
    """Whether a resumed checkpoint whose next round is ``next_round`` must wait for the others before it counts as
    the newest state: it holds the result of round ``next_round - 1``, the newest state the members agreed on is of
    the round before (``latest_agreed``), and members of that agreed round other than ``me`` announced contributions
    to ``next_round - 1`` (``closing``), so they are still closing it. The set this peer applied may never have
    reached them (it stopped as it closed the round), and the result they take may differ from ours; resuming ours
    at once ran rounds alone, a round ahead of everybody."""
    return next_round == latest_agreed + 2 and bool(set(closing) - {me})


def dropped_named(dropped: AbstractSet[str], members: AbstractSet[str], limit: int) -> tuple[str, ...]:
    """The contributors an accepted set names as dropped (``AcceptedSet.dropped``): ``dropped`` that are no
    ``members``, sorted, and no more than the ``limit`` ids a set may name less its members (a set that names more
    is too large to be read anywhere, and its round would close only by a takeover). Those past the bound keep the
    phase in their error feedback, as before the list existed."""
    return tuple(sorted(set(dropped) - set(members)))[:max(0, limit - len(members))]


def member_checks(checks: Sequence[ShardChecks], round_: int, members: AbstractSet[str]) -> list[ShardChecks]:
    """The checksum records of round ``round_`` that count: those of its members. Votes from keys that were not
    members (unannounced, newly minted, or simply left out) never move the majority."""
    return [c for c in checks if c.round == round_ and c.peer in members]


@dataclass(frozen=True)
class Votes:
    """The checksum records that vote on a round's state, each cut to the shards its signer contributed
    (:func:`vote_checks`), and ``whole``: the signers that contributed every shard (full replicas), whose votes
    rank first (:func:`majority_checksums`)."""

    checks: list[ShardChecks]
    whole: frozenset[str] = frozenset()


def holds_all(held: AbstractSet[int] | None, n_shards: int | None) -> bool:
    """Whether a member that contributed ``held`` (None: every shard) contributed all ``n_shards`` shards; with
    ``n_shards`` None every member counts alike (a vote weighs the same whoever casts it)."""
    return n_shards is not None and (held is None or len(set(held)) >= n_shards)


def vote_checks(checks: Sequence[ShardChecks], round_: int, members: Mapping[str, AbstractSet[int] | None],
                n_shards: int) -> Votes:
    """The checksum records of round ``round_`` that vote, and on which shards (``members``: peer -> the shards it
    contributed to the round, None: every shard).

    Only members vote (:func:`member_checks`), each only on the shards it contributed: a stage peer that signs
    checksums of shards it does not hold counts for nothing there. Members that contributed every shard (full
    replicas) are named in the result's ``whole``: on a shard their votes decide first and stage peers' votes only
    break a tie among them, so stage peers, which hold one shard and can be many, outvote full replicas only on
    shards no full replica of the round voted on (docs/security.md)."""
    def shards_of(peer: str) -> AbstractSet[int]:
        held = members[peer]
        return range(n_shards) if held is None else held

    cut = [replace(c, checksums={s: d for s, d in c.checksums.items() if s in shards_of(c.peer)})
           for c in member_checks(checks, round_, set(members))]
    return Votes([c for c in cut if c.checksums],
                 frozenset(c.peer for c in cut if c.checksums and holds_all(members[c.peer], n_shards)))


def fingerprints_agree(a: tuple[float, float], b: tuple[float, float], rtol: float = 1e-5) -> bool:
    """Whether two shard fingerprints describe the same parameters up to float rounding."""
    scale = max(a[1], b[1], 1e-30)
    return abs(a[0] - b[0]) <= rtol * scale and abs(a[1] - b[1]) <= rtol * scale


def fingerprint_cluster(checks: Sequence[ShardChecks], round_: int, rtol: float = 1e-5) -> list[ShardChecks]:
    """The largest set of ``round_`` records whose fingerprints all agree with one member's, shard by shard.

    A dense run's notion of a majority (its replicas agree only up to float rounding); ties go to the set around
    the smallest peer id, so every peer picks the same set from the same records.
    """
    cands = sorted((c for c in checks if c.round == round_ and c.fingerprints), key=lambda c: c.peer)
    best: list[ShardChecks] = []
    for c in cands:
        group = [d for d in cands if d.fingerprints.keys() == c.fingerprints.keys()
                 and all(fingerprints_agree(c.fingerprints[s], d.fingerprints[s], rtol) for s in c.fingerprints)]
        if len(group) > len(best):
            best = group
    return best


def payload_limit(n_params: int) -> int:
    """The most bytes a shard's contribution of ``n_params`` values may take: 6 bytes per value plus 1 MiB."""
    return 6 * n_params + (1 << 20)


def majority_checksums(checks: Sequence[ShardChecks], round_: int,
                       whole: AbstractSet[str] = frozenset()) -> dict[int, str]:
    """Per shard, the checksum most peers published for ``round_``. With ``whole`` (the signers that hold every
    shard, :class:`Votes`), the checksum most of them published wins and the other votes break a tie among them;
    a tie of both goes to the smallest string."""
    tally: dict[int, dict[str, list[int]]] = {}
    for c in checks:
        if c.round != round_:
            continue
        for shard, digest in c.checksums.items():
            count = tally.setdefault(shard, {}).setdefault(digest, [0, 0])
            count[0] += c.peer in whole
            count[1] += 1
    return {s: min(v, key=lambda d: (-v[d][0], -v[d][1], d)) for s, v in tally.items()}


class Verdict(Enum):
    """What a coordinator whose turn has come does (:func:`close_verdict`)."""

    MEMBERS = "members"  # publish the contributions that passed verification
    EMPTY = "empty"  # publish a set without members: nobody's parameters move, contributions stay in error feedback
    WAIT = "wait"  # wait for more


def close_verdict(admitted: int, min_contributors: int, now: float, first_seen: float, max_window: float,
                  rank: int, takeover_s: float) -> Verdict:
    """What a coordinator whose turn has come publishes.

    MEMBERS once at least ``min_contributors`` contributions passed verification; EMPTY when the manifest's
    longest window has passed after the first arrival without that many, so that no peer waits forever;
    otherwise WAIT for more.
    """
    if admitted >= min_contributors:
        return Verdict.MEMBERS
    if now >= first_seen + max_window + rank * takeover_s:
        return Verdict.EMPTY
    return Verdict.WAIT


def round_standing(checks: Sequence[ShardChecks]) -> dict[str, dict[str, int | bool]]:
    """Per peer, the last round it published a state for and whether that state is the agreed one of the newest
    round: equal checksums with the majority (sparse runs), or inside the fingerprint cluster (dense runs).
    A peer whose last record is older than the newest round is behind, not in agreement."""
    if not checks:
        return {}
    latest = max(c.round for c in checks)
    newest = [c for c in checks if c.round == latest]
    if any(c.fingerprints for c in newest):
        agreeing = {c.peer for c in fingerprint_cluster(newest, latest)}
    else:
        want = majority_checksums(newest, latest)  # per shard: a stage peer agrees on the one shard it holds
        agreeing = {c.peer for c in newest if all(want.get(s) == d for s, d in c.checksums.items())}
    return {c.peer: {"round": c.round, "agrees": c.peer in agreeing} for c in checks}



def checkpoint_ahead(next_round: int, latest_agreed: int) -> bool:
    """Whether a resumed checkpoint whose next round is ``next_round`` holds a newer state than the latest round the
    other members published an agreed state of (``latest_agreed``). Then there is nothing newer to take: the others
    came back from older checkpoints, or have not published the newer round yet, and they sync from ours, which the
    peer serves as it starts. Syncing back to theirs would throw away the rounds the checkpoint holds (and, once the
    others synced from the peer, theirs too)."""
    return next_round > latest_agreed + 1


def checks_settled(checks: Sequence[ShardChecks], mine: ShardChecks, members: Mapping[str, AbstractSet[int] | None],
                   online: AbstractSet[str] | None = None, moved_on: AbstractSet[str] = frozenset(),
                   n_shards: int | None = None) -> bool:
    """Whether a peer can stop waiting for the other members' checksums of round ``mine.round`` (``checks``: the
    records seen so far; ``members``: peer -> the shards it contributed, None for all of them).

    True once every member that may still publish has published (a member that the run's announcements no
    longer show online, ``online`` given, never will; nor will one that already published a later round's,
    ``moved_on``: a peer's record holds its latest round only), or once, for every shard we hold, the leading
    checksum among the votes seen (ours included) is ahead of every other by more than the members still to
    publish that shard could add: the majority that :func:`majority_checksums` would pick, and so our verdict, can
    no longer change. A tie or a close count keeps waiting, so a peer whose state differs still finds out.
    With ``n_shards``, votes rank as :func:`vote_checks` ranks them: full replicas' first, the rest break ties
    (a member that contributed every shard weighs more than all the others together).
    """
    r = mine.round
    # only the round's members vote, each on the shards it contributed: any other record counts for nothing
    seen = {c.peer: c for c in checks if c.round == r and c.peer != mine.peer and c.peer in members}
    pending = [p for p in members if p != mine.peer and p not in seen and p not in moved_on
               and (online is None or p in online)]
    if not pending:
        return True
    if mine.fingerprints:  # a dense run agrees up to float rounding: only a complete set of records decides it
        return False
    big = len(members) + 2  # more than all partial votes together: full replicas' votes rank first

    def weight(peer: str) -> int:
        return big + 1 if holds_all(members.get(peer, frozenset(mine.checksums)), n_shards) else 1

    def votes_on(peer: str, shard: int) -> bool:
        held = members[peer]
        return held is None or shard in held

    for shard, digest in mine.checksums.items():
        votes: dict[str, int] = {digest: weight(mine.peer)}
        for c in seen.values():
            if shard in c.checksums and votes_on(c.peer, shard):
                votes[c.checksums[shard]] = votes.get(c.checksums[shard], 0) + weight(c.peer)
        ranked = sorted(votes.values(), reverse=True)
        lead, second = ranked[0], (ranked[1] if len(ranked) > 1 else 0)
        still = sum(weight(p) for p in pending if votes_on(p, shard))
        if lead <= second + still:
            return False
    return True
