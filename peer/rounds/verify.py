"""After a round: publish our state, check it against the other members' (the verification step), and load the
agreed state from peers when ours is not it (state sync). :class:`StateSync` does these for one round loop.

How long a peer waits for the other members' checksums:

A member that left or died after its contribution was accepted never publishes its checksums; waiting the whole
``checks_wait_s`` for it cost every survivor that long (rounds of 12 s instead of 2.5 s under chaos). The wait
ends instead as soon as :func:`hlbp.peer.rounds.rules.checks_settled` says the verdict is in: every member still
announced online has published (or has already published a later round's: a peer's record holds only its latest
round, so a verifier a round behind, a straggler under overlap, would otherwise wait out the window for records
that are gone), or the records seen form a per-shard majority the others cannot overturn.
The announcements come from the same DHT poll as the checksums (one round trip for both); the members also push
their checksums to each other (:mod:`hlbp.peer.rounds.inbox`), so the wait usually ends without a DHT read.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from hlbp.peer.net.transport import TransportError
from hlbp.peer.rounds.agreement import Agreement
from hlbp.peer.rounds.config import RoundConfig
from hlbp.peer.rounds.outer import OuterConfig, make_outer
from hlbp.peer.rounds.records import RoundRecords, checks_name
from hlbp.peer.rounds.rules import (
    Votes,
    behind_members,
    checkpoint_ahead,
    checks_settled,
    result_pending,
    result_unpublished,
    round_member_shards,
    vote_checks,
)
from hlbp.peer.rounds.state import ReplicaState
from hlbp.peer.rounds.statesync import ServedState, fetch_state, shard_checksum, state_name
from hlbp.protocol import ProtocolError
from hlbp.protocol.announcement import decode_announcement, peers_key
from hlbp.protocol.roundwire import (
    KIND_ACCEPTED,
    KIND_CHECKS,
    KIND_CONTRIB,
    ShardChecks,
    checks_key,
    parse_accepted,
    parse_checks,
    parse_contrib,
    round_key,
)

logger = logging.getLogger(__name__)

MEMBER_ROUNDS_TRIED = 3  # the newest claimed rounds a sync looks at for one whose members are known


def online_members(entries: Mapping[Any, Any], run_id: str, now: float, me: str,
                   members: AbstractSet[str]) -> set[str] | None:
    """The ``members`` whose signed announcement of ``run_id`` says online, from raw DHT entries; None when the
    read tells nothing (our own announcement missing: a failed read, or a runner without announcements), so a
    lost lookup never reads as "everybody left"."""
    online: set[str] = set()
    for subkey, value in entries.items():
        if not isinstance(subkey, str) or (subkey != me and subkey not in members):
            continue
        try:
            record = decode_announcement(getattr(value, "value", value), now=now, signer=subkey, run_id=run_id)
        except ProtocolError:
            continue  # expired, forged or malformed: as good as absent
        if record.announcement.online:
            online.add(subkey)
    return online - {me} if me in online else None


def wait_for_checks(records: RoundRecords, r: int, members: Mapping[str, AbstractSet[int] | None],
                    mine: ShardChecks, n_shards: int | None = None) -> list[ShardChecks]:
    """The round-r checksum records seen when the wait ended: settled, ``checks_wait_s`` passed, or stopping.
    ``records``: the round loop's records; ``members``: peer -> shards it contributed (``n_shards``: the votes
    rank as :func:`~hlbp.peer.rounds.rules.vote_checks` ranks them)."""
    from hivemind.utils import get_dht_time

    cfg = records.cfg
    run = cfg.run_id
    deadline = time.monotonic() + cfg.checks_wait_s
    while True:
        raw_checks, raw_peers = records.poller.entries(checks_key(run), peers_key(run))
        latest = records.records(checks_key(run), parse_checks, raw_checks)
        # a member that published round r + 1 since votes on r with the checksums its record carries from r
        checks = [vote for c in latest if (vote := c.as_of(r)) is not None]
        moved_on = {c.peer for c in latest if c.round > r}  # no round-r record of theirs will come
        online = online_members(raw_peers, run, get_dht_time(), records.me, set(members))
        if (checks_settled(checks, mine, members, online, moved_on, n_shards) or time.monotonic() >= deadline
                or records.stop.is_set()):
            return checks
        records.inbox.wait(cfg.poll_s)  # wakes at once for a pushed record or a finished DHT read


def sample_checks(records: RoundRecords, r: int, sample: Sequence[str], mine: ShardChecks) -> list[ShardChecks]:
    """The round-r checksum records of ``sample`` fetched from them, each tried until it answers, the verdict is
    settled (:func:`~hlbp.peer.rounds.rules.checks_settled` over the sample) or ``checks_wait_s`` passed."""
    cfg = records.cfg
    deadline = time.monotonic() + cfg.checks_wait_s
    got: dict[str, ShardChecks] = {}
    peers = [p for p in dict.fromkeys(sample) if p != records.me]
    with ThreadPoolExecutor(max(1, len(peers))) as pool:
        while not records.stop.is_set():
            missing = [p for p in peers if p not in got]
            wait_s = max(0.5, min(5.0, deadline - time.monotonic()))
            for p, found in zip(missing, pool.map(records.fetch_checks, missing, [r] * len(missing), [wait_s] * len(missing))):
                if found is not None:
                    got[p] = found
            if (checks_settled(list(got.values()), mine, dict.fromkeys(peers)) or time.monotonic() >= deadline):
                break
            records.stop.wait(cfg.poll_s)  # a seat that has not applied the round yet serves nothing: try again
    return list(got.values())


class StateSync:
    """Our state after each round, published and checked against the members', and the agreed state loaded from
    peers (see the module docstring). ``held``: the shards we vouch for; ``agreement``: how the run tells the
    agreed state (:mod:`hlbp.peer.rounds.agreement`)."""

    def __init__(self, me: str, shards: Sequence[Sequence[str]], held: Sequence[int],
                 shapes: Sequence[Mapping[str, tuple[int, ...]]], cfg: RoundConfig, outer_cfg: OuterConfig,
                 transport: Any, records: RoundRecords, agreement: Agreement, member_votes: bool = True) -> None:
        self.me, self.shards, self.held, self.shapes = me, shards, held, shapes
        self.cfg, self.outer_cfg, self.transport, self.records = cfg, outer_cfg, transport, records
        self.agreement = agreement
        # only a round's members vote on its state (rounds with accepted sets); the dense baseline's all-reduce
        # publishes no accepted set, so there every checksum record of the round counts
        self.member_votes = member_votes
        self.last_published: ShardChecks | None = None  # our latest published checksums, carried in the next

    def checks(self, state: ReplicaState, r: int) -> ShardChecks:
        """Our checksums (and fingerprints) of the held shards, as after round r."""
        sums = {s: shard_checksum(state.anchor, self.shards[s], state.outers[s].state_tensors()) for s in self.held}
        return ShardChecks(self.me, r, sums, self.agreement.fingerprints(state.anchor, self.shards))

    def publish(self, state: ReplicaState, mine: ShardChecks, to: AbstractSet[str] = frozenset(),
                sampled: bool = False) -> None:
        """Serve our state after round ``mine.round`` and publish its checksums (and fingerprints): in the DHT,
        served for fetching (:func:`~hlbp.peer.rounds.records.checks_name`), and pushed to the round's members
        ``to`` as well as the live peers, unless the round's readers ``sampled`` them (a committee)."""
        r = mine.round
        last, self.last_published = self.last_published, mine
        if self.member_votes and last is not None and last.round == r - 1 and not mine.previous:
            mine = replace(mine, previous=dict(last.checksums))  # for members verifying round r - 1 late
        for s in self.held:
            self.transport.put_lazy(state_name(r, s), ServedState(state.anchor, self.shards[s],
                                                                  state.outers[s].state_tensors()))
        self.transport.drop([state_name(r - 2, s) for s in self.held] + [checks_name(r - 2)])
        value = self.records.store(checks_key(self.cfg.run_id), mine.to_body(self.cfg.run_id), KIND_CHECKS, to,
                                   only=frozenset() if sampled else None)
        self.transport.put(checks_name(r), value)

    def verify(self, r: int, members: Mapping[str, AbstractSet[int] | None], mine: ShardChecks,
               sample: Sequence[str] | None = None) -> bool:
        """Compare our state after round r with the other members' (peer -> the shards it contributed, None: all),
        waiting until the verdict is settled or ``checks_wait_s`` passed. ``sample``: with a committee, the
        peers whose records we fetch instead (seats of the next round's committee, which applied round r)."""
        if sample is not None:
            return self.agreement.agrees(sample_checks(self.records, r, sample, mine), mine)
        if not self.member_votes:
            checks = wait_for_checks(self.records, r, members, mine)
            return self.agreement.agrees([c for c in checks if c.peer != self.me], mine)
        # our own vote counts as a member's, on the shards we hold (also when we were left out, as it always has)
        voters = {**members, self.me: members.get(self.me, None if len(self.held) == len(self.shards)
                                                    else set(self.held))}
        checks = wait_for_checks(self.records, r, voters, mine, len(self.shards))
        votes = vote_checks([*[c for c in checks if c.peer != self.me], mine], r, voters, len(self.shards))
        mine_vote = next((c for c in votes.checks if c.peer == self.me), ShardChecks(self.me, r, {}))
        return self.agreement.agrees([c for c in votes.checks if c.peer != self.me], mine, mine_vote, votes.whole)

    def agreed_round(self) -> tuple[int, Votes] | None:
        """The newest round others published checksums for whose members are known from its records, and the
        members' votes on it (not ours); None when there is none. Only members vote: checksum records under keys
        that were not members of that round count for nothing, so throwaway keys cannot outvote the run. The
        newest few claimed rounds are tried, newest first, so a far-future claim cannot hide the real one."""
        checks = [c for c in self.records.latest_checks() if c.peer != self.me]
        if not self.member_votes:
            return (max(c.round for c in checks), Votes(checks)) if checks else None
        for r in sorted({c.round for c in checks}, reverse=True)[:MEMBER_ROUNDS_TRIED]:
            votes = vote_checks(checks, r, self.members(r) or {}, len(self.shards))
            if votes.checks:
                return r, votes
        return None

    def closing(self, r: int, members: AbstractSet[str]) -> set[str]:
        """The ``members`` that announced contributions to round ``r`` (signed notices of this run) and are online
        by their announcements, when those could be read: the peers that may still close round r. One that left or
        died closes nothing, and a resumed peer does not wait for it."""
        from hivemind.utils import get_dht_time

        run = self.cfg.run_id
        key = round_key(run, r, KIND_CONTRIB)
        raw, peers = self.records.read(key, peers_key(run))
        senders = {n.sender for n in self.records.records(key, parse_contrib, raw, round_=r)} & set(members)
        online = online_members(peers, run, get_dht_time(), self.me, senders)
        return senders if online is None else senders & online

    def await_closing(self, next_round: int, stop: Any, pause_s: float) -> None:
        """Wait, looking every ``pause_s`` (or until ``stop`` is set), while a resumed checkpoint whose next round is
        ``next_round`` holds a round the members of the newest agreed state are still closing
        (:func:`~hlbp.peer.rounds.rules.result_pending`), and at most as long as a round can stay open: once they
        publish its result, :meth:`current` compares ours with theirs. Only members of the agreed round that are
        online count (:meth:`closing`), so notices under throwaway keys, or of peers gone since, hold nobody up."""
        deadline = time.monotonic() + self.cfg.longest_open_s()
        for attempt in itertools.count():
            found = self.agreed_round()
            if found is None:
                return
            latest, votes = found
            if next_round != latest + 2:
                return  # not one round past the agreed state: no DHT read on an ordinary resume
            closing = self.closing(next_round - 1, {c.peer for c in votes.checks})
            if not result_pending(next_round, latest, closing, self.me):
                return
            if attempt == 0:
                logger.info("members of round %d are still closing round %d, which our checkpoint holds; waiting "
                            "for their result before resuming", latest, next_round - 1)
            if time.monotonic() >= deadline or stop.wait(pause_s):
                return

    def members(self, r: int) -> dict[str, frozenset[int]] | None:
        """The members of round ``r`` and the shards each contributed, as its records (or a checkpoint's evidence,
        stored again at a restart) show; None when they are not known."""
        run = self.cfg.run_id
        keys = (round_key(run, r, KIND_CONTRIB), round_key(run, r, KIND_ACCEPTED))
        contribs, sets = self.records.read(*keys)
        parsed = self.records.records(keys[0], parse_contrib, contribs, round_=r)
        notices = {n.sender: set(n.digests) for n in parsed}
        return round_member_shards(r, notices, self.records.records(keys[1], parse_accepted, sets, round_=r),
                                   len(self.shards), {n.sender for n in parsed if not n.dialable})

    def await_members(self, r: int, stop: Any, attempts: int, pause_s: float) -> None:
        """Wait, at most ``attempts`` looks ``pause_s`` apart (or until ``stop`` is set), until every other member
        of round ``r`` has published checksums of round r or later: before a resumed peer compares its state with
        the others', the members that may be restarting beside it show whether a newer state exists."""
        self._await(r, lambda members, checks: bool(behind_members(members, checks, r, self.me)), stop, attempts,
                    pause_s, "waiting for the members of round %d to come back before comparing states")

    def await_result(self, r: int, stop: Any, attempts: int, pause_s: float) -> None:
        """Wait, at most ``attempts`` looks ``pause_s`` apart (or until ``stop`` is set), while round ``r`` closed and
        none of its other members has published its result (:func:`~hlbp.peer.rounds.rules.result_unpublished`):
        a peer starting beside members that are coming back with that result would otherwise take the older state
        and redo the round they hold."""
        self._await(r, lambda members, checks: result_unpublished(members, checks, r, self.me), stop, attempts,
                    pause_s, "round %d closed and none of its members has published its result yet; waiting")

    def _await(self, r: int, waiting: Callable[[AbstractSet[str], list[ShardChecks]], bool], stop: Any,
               attempts: int, pause_s: float, note: str) -> None:
        """Look at round ``r``'s members and every peer's latest checksums up to ``attempts`` times, ``pause_s``
        apart, while ``waiting(members, checks)`` says so (logging ``note`` once), or until ``stop`` is set."""
        for attempt in range(attempts):
            if not waiting(set(self.members(r) or {}), self.records.latest_checks()):
                return
            if attempt == 0:
                logger.info(note, r)
            if stop.wait(pause_s):
                return

    def current(self, state: ReplicaState) -> bool | None:
        """Whether a resumed ``state`` is the agreed one of the latest round others published (None: nobody
        published any, or only rounds before ours (:func:`~hlbp.peer.rounds.rules.checkpoint_ahead`), so there is
        nothing newer to compare with)."""
        found = self.agreed_round()
        if found is None:
            return None
        latest, votes = found
        if checkpoint_ahead(state.round, latest):
            logger.info("the members' newest agreed state is of round %d, older than our checkpoint's round %d: "
                        "resuming ours", latest, state.round - 1)
            return None
        mine = self.checks(state, latest)
        whole = votes.whole | ({self.me} if len(self.held) == len(self.shards) else set())
        return state.round == latest + 1 and self.agreement.agrees(votes.checks, mine, whole=whole)

    def sync(self, state: ReplicaState, attempts: int = 3, pause_s: float = 0.0, stop: Any = None) -> int | None:
        """Load the newest agreed state of the held shards from peers into ``state``, in parallel from different
        donors, verified by checksum; then serve it and push its checksums to the peers whose records we read
        (they count us live and push us the next rounds' records, so a joiner's first trained phase hears of the
        others' notices at once instead of by polling the DHT). Returns the bytes fetched, or None when no agreed
        state exists yet (a fresh run: ``state`` is then as good as any, and in sync) or every attempt failed."""
        for attempt in range(attempts):
            if attempt and pause_s and (stop.wait(pause_s) if stop is not None else time.sleep(pause_s)):
                return None
            found = self.agreed_round()
            if found is None:
                state.in_sync = True  # no round with known members published a state: ours is as good as any
                return None
            latest, votes = found
            agreed = self.agreement.agreed(votes.checks, latest, self.held, len(self.shards), votes.whole)
            if agreed is None or not agreed[0]:
                # the newest round's checksums may still be arriving (its members publish as they finish it)
                logger.info("no agreed state of round %d to fetch yet; retrying", latest)
                continue
            donors, expect = agreed
            random.Random(f"{self.me}|{latest}").shuffle(donors)
            try:
                states, n_bytes = fetch_state(self.transport, donors, latest, {s: self.shapes[s] for s in self.held},
                                              expect, self.cfg.max_payload_bytes, self.cfg.fetch_timeout_s,
                                              self.cfg.fetch_workers)
            except TransportError as exc:
                logger.warning("state sync for round %d failed (%s); retrying", latest, exc)
                continue
            for s, shard in states.items():
                state.anchor.update({n: t.clone() for n, t in shard.params.items()})
                fresh = make_outer(self.outer_cfg)
                fresh.load_state(shard.outer)
                state.outers[s] = fresh  # a synced peer starts with an empty error-feedback buffer
            state.round, state.in_sync, state.guard_losses, state.evidence = latest + 1, True, [], {}
            logger.info("synced state of round %d from %d donors", latest, len(donors))
            self.publish(state, self.checks(state, latest), {c.peer for c in votes.checks})
            return n_bytes
        return None
