"""Which contributions a round may take under the run's gather rule, as this peer sees it: the standing its
accepted sets gave, the contenders of a round, the ones a coordinator selects, and whether a published set keeps
the rule.

The rule itself is pure (:mod:`hlbp.peer.rounds.gather`); :class:`Selection` holds this peer's side of it: the
standing record (the replica state's, saved in its checkpoints) and the coordinators it caught breaking the rule,
whom it bans like senders of garbage. The closer (:mod:`hlbp.peer.rounds.closer`) asks it what to prefetch, what
to admit and which sets count.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet

from hlbp.peer.rounds.bans import RoundBans
from hlbp.peer.rounds.committee import CommitteeRule, order_checked
from hlbp.peer.rounds.gather import BreachKind, GatherRule, Standing, breach, candidates, select
from hlbp.protocol.roundwire import AcceptedSet, ContribNotice

Notices = dict[str, ContribNotice]


class Selection:
    """This peer's side of the gather rule ``rule`` over ``n_shards`` shards.

    ``allowed``: the run's allow-list (each listed peer has standing from the start); ``bans``: whom the round loop
    refuses (a coordinator whose set breaks the rule is banned through it); ``committee``: the run's committee rule
    (with a committee, a member checks the gather order only in the rounds whose order it can know); ``standing``:
    the record of who was selected when (a fresh one when None)."""

    def __init__(self, n_shards: int, rule: GatherRule, allowed: Sequence[str], bans: RoundBans,
                 committee: CommitteeRule, standing: Standing | None = None) -> None:
        self.n_shards, self.rule, self.allowed, self.bans, self.committee = n_shards, rule, allowed, bans, committee
        self.standing = standing if standing is not None else Standing(rule.memory)
        self.breaches: set[tuple[int, str]] = set()  # (round, coordinator) of sets refused for breaking the rule
        # (round, coordinator) of the breaches judged from the standing (the order, the newcomers), not the cap
        self.order_breaches: set[tuple[int, str]] = set()

    def veterans(self, r: int) -> dict[str, int]:
        """The contributors with standing in round r (:class:`~hlbp.peer.rounds.gather.Standing`); in a closed run
        every allowed peer has standing from the start, as if last selected ``memory`` rounds ago."""
        held = self.standing.veterans(r)
        return {**{p: r - self.rule.memory for p in self.allowed}, **held}

    def contenders(self, r: int, notices: Notices) -> dict[str, frozenset[int]]:
        """Round r's contributors that may be selected: not banned, naming shards of the run (peer -> shards)."""
        return {p: frozenset(n.digests) for p, n in notices.items()
                if n.digests and set(n.digests) <= set(range(self.n_shards)) and not self.bans.banned(p, r)}

    def likely(self, r: int, notices: Notices) -> Notices:
        """The notices of the contributions the gather rule selects if all of them pass (all when uncapped): what
        a member fetches before the accepted set."""
        if not self.rule.capped:
            return notices
        return {p: notices[p] for p in select(r, self.contenders(r, notices), self.veterans(r), self.rule)}

    def choose(self, r: int, notices: Notices, admit: Callable[[Notices], Notices]) -> Notices:
        """What we accept when we coordinate round r: under the run's gather rule the first F per shard of the
        first F + R contenders that ``admit`` passes (reserves replace selected ones that fail); uncapped, every
        contribution that passes."""
        if not self.rule.capped:
            return admit(notices)
        veterans = self.veterans(r)
        pool = candidates(r, self.contenders(r, notices), veterans, self.rule)
        passed = admit({p: notices[p] for p in pool})
        chosen = select(r, {p: frozenset(n.digests) for p, n in passed.items()}, veterans, self.rule)
        return {p: passed[p] for p in chosen}

    def keeps_rule(self, r: int, s: AcceptedSet, notices: Notices) -> bool:
        """Whether accepted set ``s`` keeps the gather rule as far as this peer can tell
        (:func:`~hlbp.peer.rounds.gather.breach`). Its coordinator, once found breaking it, is banned like a sender
        of garbage and no longer coordinates while banned: every in-sync peer with the same standing refuses the
        same set, and the next coordinator in turn takes over."""
        if not self.rule.capped or not s.members:
            return True
        if (r, s.coordinator) in self.breaches:
            return False
        members = {p: frozenset(d) for p, _t, d in s.members}
        seen = self.contenders(r, notices) if order_checked(r, self.committee) else {}
        found = breach(r, members, seen, self.standing, self.rule, self.veterans(r))
        if found is None:
            return True
        self.breaches = {x for x in self.breaches if x[0] >= r - 2} | {(r, s.coordinator)}
        self.order_breaches = {x for x in self.order_breaches if x[0] >= r - 2}
        if found.kind is not BreachKind.OVER_CAP:
            self.order_breaches.add((r, s.coordinator))
        self.bans.ban_by_guard(r, s.coordinator, f"its accepted set breaks the gather rule: {found}")
        return False

    def forget(self, r: int) -> None:
        """We found in round r that we took a set the others did not: drop the standing, and pardon the coordinators
        we banned in the last rounds for breaking the gather order, which we judged from that standing. A set over
        the cap needs no standing to judge, so those bans stay."""
        self.standing.forget()
        pardoned = {c for x, c in self.order_breaches if x >= r - 2}
        for coordinator in sorted(pardoned):
            self.bans.pardon(coordinator)
        self.order_breaches.clear()
        self.breaches = {x for x in self.breaches if x[1] not in pardoned}

    def full_without(self, accepted: AcceptedSet, shards: AbstractSet[int]) -> bool:
        """Whether ``accepted`` left out a contribution to ``shards`` because the gather set was full (every one of
        those shards already holds F members), not because it came late."""
        if not self.rule.capped:
            return False
        count: dict[int, int] = {}
        for _p, _t, d in accepted.members:
            for s in d:
                count[s] = count.get(s, 0) + 1
        return bool(shards) and all(count.get(s, 0) >= self.rule.size for s in shards)

    def took(self, r: int, accepted: AcceptedSet) -> None:
        """Record round r's accepted set in the standing."""
        self.standing.record(r, accepted.senders())

    def late_turn(self, r: int) -> bool:
        """Whether we take our turn to coordinate round r only after everyone else's: our standing misses rounds
        (we joined or resynced lately), so the set we would choose breaks the order that warm members compute."""
        return self.rule.capped and not self.standing.warm(r)
