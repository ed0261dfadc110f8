"""A protocol simulator: the round protocol's pure rules at N = 100 to 1000 peers, driven by modelled links.

No processes, no sockets, no model: every peer is a record with a link (latency, up and down bandwidth) and a
speed, and each round is computed as a timeline. What runs is the protocol's own decisions: the turn order
(:func:`hlbp.peer.rounds.rules.turn_order`), the gather rule (:mod:`hlbp.peer.rounds.gather`: standing,
selection, reserves, the members' check) and error feedback (a contribution left out stays with its sender and is
sent, whole, when it is next selected). Churn: each round a share of the peers leaves without notice and as many
new ones join; a joiner loads the state first and contributes from its next round.

What is modelled is how hlbp moves bytes today: every notice, accepted set and checksum record is pushed to every
live peer (N records each); the members fetch the selected payloads from their senders while the round is open,
and every other peer fetches each from a random member (the members serve what they verified), so the F members
between them upload a payload to each of the N - F others. The counts are per peer and round:
``records_per_peer_round`` (received),
``recv_bytes_per_peer_round`` / ``sent_bytes_per_peer_round`` (payloads), the most any sender uploaded, the
payloads each peer fetched (the coordinator fetches up to F + R; the others F).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

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
    seed: int = 0


@dataclass
class _Peer:
    pid: str
    speed: float
    latency_s: float
    bps: float
    joined: int
    pending: int = 0  # inner phases whose pseudo-gradient waits in error feedback, unsent
    selected: list[int] = field(default_factory=list)


def simulate_protocol(cfg: ProtocolSimConfig) -> dict[str, Any]:
    """Run ``cfg.rounds`` rounds; per-peer-per-round traffic, agreement and selection statistics."""
    rng = random.Random(cfg.seed)
    rule = GatherRule(cfg.gather, cfg.reserves)
    standing = Standing(rule.memory)  # in-sync peers take the same sets, so they hold the same standing
    cold = Standing(rule.memory)  # a joiner's: it has not recorded the rounds before it joined
    counter = 0

    def new_peer(r: int) -> _Peer:
        nonlocal counter
        counter += 1
        return _Peer(f"peer{counter:06d}", rng.lognormvariate(0.0, cfg.speed_spread),
                     rng.uniform(*cfg.latency_ms) / 1e3, rng.uniform(*cfg.mbps) * 1e6 / 8, r)

    peers = {p.pid: p for p in (new_peer(0) for _ in range(cfg.n))}
    prior: dict[str, frozenset[int]] = {}
    totals = {"records": 0, "recv": 0, "sent": 0, "fetched_max": 0, "sent_max": 0, "peer_rounds": 0}
    closed = agreed = refused_sets = 0
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
        order = turn_order(r, {q: s for q, s in prior.items() if q in peers}, notices, 1,
                           announced=set(notices))
        coordinator = peers[order[0]]
        first = min(announce.values())
        # it closes when every announced notice has reached it, or at the window's end
        heard = {q: announce[q] + peers[q].latency_s + coordinator.latency_s for q in notices}
        close_at = min(max(heard.values()), first + cfg.window_s)
        seen = {q: s for q, s in notices.items() if heard[q] <= close_at}
        veterans = standing.veterans(r)
        pool = candidates(r, seen, veterans, rule)
        failed = {q for q in pool if q != coordinator.pid and rng.random() < cfg.fetch_failure}
        chosen = select(r, {q: seen[q] for q in pool if q not in failed}, veterans, rule)
        fetch_s = max((cfg.payload_bytes / min(peers[q].bps, coordinator.bps) + peers[q].latency_s
                       for q in pool if q != coordinator.pid), default=0.0)
        set_at = close_at + fetch_s
        members = {q: notices[q] for q in chosen}
        # every in-sync peer checks the set against the notices that reached it before the set did (a joiner's
        # standing is cold: it checks the cap only), then fetches the members' payloads it lacks
        set_sent = set_at + coordinator.latency_s
        in_sync = [p for p in live if p.joined < r or r == 0]
        refusing = [p for p in in_sync
                    if breach(r, members, {q: s for q, s in notices.items()
                                           if announce[q] + peers[q].latency_s <= set_sent},
                              standing if p.joined == 0 else cold, rule) is not None]
        refused_sets += bool(refusing)
        closed += bool(chosen)
        agreed += bool(chosen) and not refusing
        uploads: dict[str, int] = {}
        for p in live:
            fetched = [q for q in (pool if p is coordinator else chosen) if q != p.pid]
            for q in fetched:
                # as Payloads._fetch does: a member (or the coordinator) prefetched it from its sender; anyone else
                # tries a random member other than the sender first, which holds it by then
                holders = [m for m in chosen if m not in (q, p.pid)]
                source = q if p.pid in members or p is coordinator or not holders else rng.choice(holders)
                uploads[source] = uploads.get(source, 0) + 1
            totals["recv"] += cfg.payload_bytes * len(fetched)
            totals["fetched_max"] = max(totals["fetched_max"], len(fetched))
            # pushed records: every live peer's notice and checksums, and the accepted set
            totals["records"] += 2 * (len(live) - 1) + 1
        sent = {q: n * cfg.payload_bytes for q, n in uploads.items()}
        totals["sent"] += sum(sent.values())
        totals["sent_max"] = max([totals["sent_max"], *sent.values()])
        totals["peer_rounds"] += len(live)
        slowest = max((cfg.payload_bytes * len(chosen) / p.bps + p.latency_s for p in live), default=0.0)
        durations.append(set_at + slowest - first)
        standing.record(r, chosen)
        prior = dict(members)
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
        "record_bytes_per_peer_round": RECORD_BYTES * totals["records"] / n_pr,
        "mean_round_span_s": sum(durations) / len(durations) if durations else 0.0,
        "selection_wait_rounds": {"mean": sum(waits) / len(waits) if waits else 0.0,
                                  "max": max(waits, default=0)},
        "peers_at_end": len(peers),
        "founders_left": len(long_lived),
        "founders_never_selected": sum(1 for p in long_lived if not p.selected),
    }
