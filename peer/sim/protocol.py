"""A protocol simulator: the round protocol's pure rules at N = 100 to 1000 peers, driven by modelled links.

No processes, no sockets, no model: every peer is a record with a link (latency, up and down bandwidth) and a
speed, and each round is computed as a timeline. What runs is the protocol's own decisions: the turn order
(:func:`hlbp.peer.rounds.rules.turn_order`), the gather rule (:mod:`hlbp.peer.rounds.gather`: standing,
selection, reserves, the members' check) and error feedback (a contribution left out stays with its sender and is
sent, whole, when it is next selected). Churn: each round a share of the peers leaves without notice and as many
new ones join; a joiner loads the state first and contributes from its next round.

Round records go as the manifest's committee says (:mod:`hlbp.peer.rounds.committee`). With one of W seats, each
notice reaches its holder only, each holder forwards the part the gather rule could select to the leads in one
message, the coordinator (the first lead still there; the next seat after the leads' turns when none is) sends the
accepted set to the seats and each holder relays it to the senders whose notices it holds; a peer whose holder left,
and a joiner, reads the round's accepted set from the DHT (one record); after the round each peer reads ``samples``
checksum records from the next round's seats. A holder that left loses its part of the notices for that round. The
run starts under way: the ``LOOKBACK`` rounds before round 0 closed with F founders each. Without a committee every
notice, accepted set and checksum record is pushed to every live peer (2N records a peer).

Payloads move as hlbp moves them: the coordinator fetches its candidates from their senders while the round is
open, and every other peer fetches each accepted payload down that payload's fetch tree
(:mod:`hlbp.peer.rounds.spread`: from its parent, or the nearest of its chain still there), so a peer uploads about F
payloads a round and at most ``FANOUT`` of each; with ``trees`` off, as before the trees, every peer but the members
fetches each payload from a random member (each member then uploads about N). The counts are per peer and round:
``records_per_peer_round`` (received; the most any peer received in any round, and sent), ``recv_bytes_per_peer_round``
/ ``sent_bytes_per_peer_round`` (payloads), the most any sender uploaded, the payloads each peer fetched (the
coordinator fetches up to F + R; the others F).
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from hlbp.peer.rounds import spread
from hlbp.peer.rounds.closer import ONLINE_EVERY
from hlbp.peer.rounds.committee import (
    LOOKBACK,
    CommitteeRule,
    check_sample,
    committee,
    forwarded,
    holder,
    leads,
    relayed_to,
)
from hlbp.peer.rounds.gather import GatherRule, Standing, breach, candidates, select
from hlbp.peer.rounds.rules import turn_order

RECORD_BYTES = 400  # a signed notice, accepted-set entry or checksum record, about


@dataclass(frozen=True)
class ProtocolSimConfig:
    """A simulated run: N peers at the start, the cap, churn, and the links and payload sizes modelled."""

    n: int = 1000
    rounds: int = 30
    gather: int = 8
    reserves: int = 4
    churn: float = 0.1  # share of peers that leave, and of new ones that join, per round
    payload_bytes: int = 48_000  # one contribution (the tiny model's measured 47.6 KB; the 1b preset: 18.6 MB)
    inner_phase_s: float = 60.0  # a median peer's H inner steps
    speed_spread: float = 0.3  # log-normal sigma of peer speed
    latency_ms: tuple[float, float] = (10.0, 150.0)  # one-way, uniform
    mbps: tuple[float, float] = (20.0, 200.0)  # each direction, uniform
    window_s: float = 30.0  # the coordinator's collection window after the first notice
    fetch_failure: float = 0.02  # share of payload fetches that fail (a peer gone, a broken link)
    committee: int = 0  # W seats (0: records all-to-all, as without a committee); rounds/committee.py
    leads: int = 3
    samples: int = 4
    takeover_s: float = 3.0
    seed: int = 0
    trees: bool = True  # payloads come down fetch trees (rounds/spread.py); False: every peer fetches from a member


@dataclass
class _Peer:
    pid: str
    speed: float
    latency_s: float
    bps: float
    joined: int
    pending: int = 0  # inner phases whose pseudo-gradient waits in error feedback, unsent
    selected: list[int] = field(default_factory=list)


def seats_of(r: int, recent: list[dict[str, frozenset[int]]], rule: CommitteeRule) -> tuple[str, ...]:
    """Round r's committee as :class:`hlbp.peer.rounds.seating.Seating` draws it: round r - 2's members ranked,
    then those of the rounds before (``recent``: the last rounds' members, oldest first, ending with round r - 1)."""
    return committee(r, list(reversed(recent[:-1])), rule)


def simulate_protocol(cfg: ProtocolSimConfig) -> dict[str, Any]:
    """Run ``cfg.rounds`` rounds; per-peer-per-round traffic, agreement and selection statistics."""
    rng = random.Random(cfg.seed)
    rule = GatherRule(cfg.gather, cfg.reserves)
    seats_rule = CommitteeRule(cfg.committee, cfg.leads, cfg.samples)
    standing = Standing(rule.memory)  # in-sync peers take the same sets, so they hold the same standing
    cold = Standing(rule.memory)  # a joiner's: it has not recorded the rounds before it joined
    counter = 0

    def new_peer(r: int) -> _Peer:
        nonlocal counter
        counter += 1
        return _Peer(f"peer{counter:06d}", rng.lognormvariate(0.0, cfg.speed_spread),
                     rng.uniform(*cfg.latency_ms) / 1e3, rng.uniform(*cfg.mbps) * 1e6 / 8, r)

    peers = {p.pid: p for p in (new_peer(0) for _ in range(cfg.n))}
    # the run is under way: the rounds before round 0 closed with F founders each as members
    founders = sorted(peers)
    recent: list[dict[str, frozenset[int]]] = [
        {q: frozenset({0}) for q in rng.sample(founders, min(cfg.n, max(1, rule.size)))} for _ in range(LOOKBACK)]
    prior = recent[-1]
    totals = {"records": 0, "recv": 0, "sent": 0, "fetched_max": 0, "sent_max": 0, "peer_rounds": 0,
              "records_max": 0, "records_sent_max": 0}
    closed = agreed = refused_sets = 0
    online: set[str] = set(peers)  # the peers announced online as a peer last read them
    waits: list[int] = []
    durations: list[float] = []
    for r in range(cfg.rounds):
        if r:
            for pid in [p for p in peers if rng.random() < cfg.churn]:
                del peers[pid]
            for _ in range(round(cfg.churn * cfg.n)):
                p = new_peer(r)
                peers[p.pid] = p
        live = list(peers.values())
        contributors = [p for p in live if p.joined < r or r == 0]  # a joiner loads the state this round
        announce = {p.pid: cfg.inner_phase_s * p.speed for p in contributors}
        for p in contributors:
            p.pending += 1
        notices = {p.pid: frozenset({0}) for p in contributors}
        first = min(announce.values())
        received: Counter[str] = Counter()  # round records each peer received this round, and sent
        sent_records: Counter[str] = Counter()
        # committee of round r: the first W of the agreed head of its turn order (last round's members, ranked),
        # whether or not they are still there; none (all-to-all) when the rule is off
        seats = seats_of(r, recent, seats_rule)
        veterans = standing.veterans(r)
        if seats:
            leaders = leads(seats, seats_rule)
            # each notice goes to its holder; a holder that left loses its part for this round
            parts: dict[str, dict[str, frozenset[int]]] = {}
            arrive: dict[str, float] = {}
            for q, shards in notices.items():
                h = holder(r, q, seats, seats_rule)
                sent_records[q] += 1
                if h in peers:
                    received[h] += 1
                    parts.setdefault(h, {})[q] = shards
                    arrive[q] = announce[q] + peers[q].latency_s + peers[h].latency_s
            # the coordinator: the first lead still there; with none, the next seat takes over after the leads'
            # turns and the holders forward to it then
            in_charge = next((c for c in seats if c in peers), None)
            if in_charge is None:
                prior, recent = {}, []
                continue
            coordinator = peers[in_charge]
            turns = seats.index(in_charge)
            targets = [c for c in leaders if c in peers] if in_charge in leaders else [in_charge]
            view: dict[str, frozenset[int]] = dict(parts.get(in_charge, {}))
            heard: dict[str, float] = {}
            for h, part in parts.items():
                sent_on = forwarded(r, part, veterans, rule)
                ready = min(max(arrive[q] for q in part), first + cfg.window_s)
                if h == in_charge:
                    heard.update({q: arrive[q] for q in part})
                    continue
                sent_records[h] += len(targets)
                for t in targets:
                    received[t] += 1
                for q in sent_on:
                    view[q] = part[q]
                    heard[q] = ready + peers[h].latency_s + coordinator.latency_s
            # it closes once every holder's forward is in, or a takeover delay past its window (the holders forward
            # at their window's end at the latest)
            close_at = min(max(heard.values(), default=first), first + cfg.window_s + cfg.takeover_s) \
                + turns * cfg.takeover_s
            seen = {q: s for q, s in view.items() if heard[q] <= close_at}
        else:
            order = turn_order(r, {q: s for q, s in prior.items() if q in peers}, notices, 1, announced=set(notices))
            coordinator = peers[order[0]]
            heard = {q: announce[q] + peers[q].latency_s + coordinator.latency_s for q in notices}
            close_at = min(max(heard.values()), first + cfg.window_s)
            seen = {q: s for q, s in notices.items() if heard[q] <= close_at}
        pool = candidates(r, seen, veterans, rule)
        failed = {q for q in pool if q != coordinator.pid and rng.random() < cfg.fetch_failure}
        chosen = select(r, {q: seen[q] for q in pool if q not in failed}, veterans, rule)
        fetch_s = max((cfg.payload_bytes / min(peers[q].bps, coordinator.bps) + peers[q].latency_s
                       for q in pool if q != coordinator.pid), default=0.0)
        set_at = close_at + fetch_s
        members = {q: notices[q] for q in chosen}
        set_sent = set_at + coordinator.latency_s
        in_sync = [p for p in live if p.joined < r or r == 0]
        if seats:
            # the set goes to the seats still there, each relays it to the senders of the notices it holds; a peer
            # whose holder left (or a joiner) reads the round's accepted sets from the DHT (one record)
            relayed: set[str] = set()
            for c in seats:
                if c in peers and c != coordinator.pid:
                    received[c] += 1
                    sent_records[coordinator.pid] += 1
                if c in peers:
                    fan = relayed_to(r, c, seats, set(parts.get(c, {})), seats_rule)
                    sent_records[c] += len(fan)
                    for q in fan:
                        received[q] += 1
                    relayed |= fan
            for p in live:
                if p.pid not in relayed and p.pid not in seats:
                    received[p.pid] += 1
            # every peer checks the cap only (committee.order_checked): no two see the same notices
            views = {}
        else:
            for p in live:  # every live peer's notice and the accepted set, pushed to every live peer
                received[p.pid] += len(notices) - (p.pid in notices) + 1
                sent_records[p.pid] += len(live) - 1
            views = {p.pid: {q: s for q, s in notices.items() if announce[q] + peers[q].latency_s <= set_sent}
                     for p in live}
        refusing = [p for p in in_sync
                    if breach(r, members, views.get(p.pid, members), standing if p.joined == 0 else cold, rule)
                    is not None]
        refused_sets += bool(refusing)
        closed += bool(chosen)
        agreed += bool(chosen) and not refusing
        # checksums: with a committee each peer reads a sample of the members' records (each member serves its
        # readers); all-to-all, every live peer's record reaches every live peer
        # read from the next round's committee: the peers with standing, every one of which applied this round
        readable = seats_of(r + 1, [*recent, dict(members)][-LOOKBACK:], seats_rule)
        for p in live:
            if seats:
                sample = check_sample(r, p.pid, [q for q in readable if q in peers], seats_rule)
                received[p.pid] += len(sample)
                for m in sample:
                    sent_records[m] += 1
            else:
                received[p.pid] += len(live) - 1
        uploads: dict[str, int] = {}
        # as the applier does: each payload comes down its fetch tree over the peers with standing and the members
        # (spread.py); a peer asks the first of its chain still there. The coordinator fetched its candidates from
        # their senders while it admitted them.
        # the trees span the peers announced online as of the last read (every ONLINE_EVERY rounds: some have left
        # since, and their children in the trees fall back to others of their level)
        if r % ONLINE_EVERY == 0:
            online = set(peers)
        population = sorted(online)
        trees = {q: spread.tree(r, q, population, members=chosen) for q in chosen} if cfg.trees else {}
        for p in live:
            fetched = [q for q in (pool if p is coordinator else chosen) if q != p.pid]
            for q in fetched:
                if p is coordinator:  # it fetched its candidates from their senders while it admitted them
                    source = q
                elif cfg.trees:  # the first of its chain still there, else the coordinator, else the sender
                    there = [h for h in spread.chain(trees[q], p.pid, r)[:spread.TRIES] if h in peers]
                    source = there[0] if there else coordinator.pid
                else:  # a member fetched it from its sender; anyone else asks a random member
                    holders = [m for m in chosen if m not in (q, p.pid)]
                    source = q if p.pid in members or p is coordinator or not holders else rng.choice(holders)
                uploads[source] = uploads.get(source, 0) + 1
            totals["recv"] += cfg.payload_bytes * len(fetched)
            totals["fetched_max"] = max(totals["fetched_max"], len(fetched))
        totals["records"] += sum(received.values())
        totals["records_max"] = max([totals["records_max"], *received.values()])
        totals["records_sent_max"] = max([totals["records_sent_max"], *sent_records.values()])
        sent = {q: n * cfg.payload_bytes for q, n in uploads.items()}
        totals["sent"] += sum(sent.values())
        totals["sent_max"] = max([totals["sent_max"], *sent.values()])
        totals["peer_rounds"] += len(live)
        # each peer's F payloads, plus a relay's transfer per level of the trees above it (a hop waits for the
        # whole payload at its parent)
        hop = max((cfg.payload_bytes / p.bps + p.latency_s for p in live), default=0.0)
        slowest = max((cfg.payload_bytes * len(chosen) / p.bps + p.latency_s for p in live), default=0.0) \
            + (spread.depth(len(population) + 1) * hop if cfg.trees else 0.0)
        durations.append(set_at + slowest - first)
        standing.record(r, chosen)
        prior = dict(members)
        recent = [*recent, prior][-LOOKBACK:]
        for q in chosen:
            p = peers[q]
            waits.append(p.pending - 1)  # phases its contribution waited in error feedback before this round
            p.pending = 0
            p.selected.append(r)
    n_pr = max(1, totals["peer_rounds"])
    long_lived = [p for p in peers.values() if p.joined == 0]
    return {
        "rounds": cfg.rounds,
        "rounds_closed": closed,
        "rounds_agreed": agreed,
        "sets_refused_by_someone": refused_sets,
        "recv_bytes_per_peer_round": totals["recv"] / n_pr,
        "sent_bytes_per_peer_round": totals["sent"] / n_pr,
        "max_sent_bytes_one_peer_round": totals["sent_max"],
        "max_payloads_fetched_one_peer_round": totals["fetched_max"],
        "records_per_peer_round": totals["records"] / n_pr,
        "max_records_one_peer_round": totals["records_max"],
        "max_records_sent_one_peer_round": totals["records_sent_max"],
        "record_bytes_per_peer_round": RECORD_BYTES * totals["records"] / n_pr,
        "mean_round_span_s": sum(durations) / len(durations) if durations else 0.0,
        "selection_wait_rounds": {"mean": sum(waits) / len(waits) if waits else 0.0,
                                  "max": max(waits, default=0)},
        "peers_at_end": len(peers),
        "founders_left": len(long_lived),
        "founders_never_selected": sum(1 for p in long_lived if not p.selected),
    }
