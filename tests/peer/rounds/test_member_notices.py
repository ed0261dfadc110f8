"""A peer that reads a round's accepted set before the notice of one of its members waits for that notice before
it leaves the round: the next round's turn order ranks the members behind NAT last, as their own notices say, and
a peer that ranked a NATed member first waited out a window and a takeover for the set every other peer took at once
(seen in tests/peer/net/test_nat.py: one NATed replica 22 s late, and left out of the next round). A notice that
never comes holds the set for the record grace (``RoundConfig.grace_s``), not a takeover delay (18 s in a run
with stage peers).

The closer's own ``close`` on real signed records in a real inbox; the network tests run the round loop around it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import hivemind
import pytest

from hlbp.peer.rounds.bans import RoundBans
from hlbp.peer.rounds.closer import Closer
from hlbp.peer.rounds.config import RoundConfig
from hlbp.peer.rounds.outer import OuterConfig
from hlbp.peer.rounds.payloads import Payloads
from hlbp.peer.rounds.records import RoundRecords
from hlbp.peer.rounds.rules import Expected
from hlbp.protocol.identity import Identity
from hlbp.protocol.roundwire import KIND_ACCEPTED, KIND_CONTRIB, AcceptedSet, ContribNotice, round_key, sign

RUN = "notices-test"
IDS = {name: Identity.generate() for name in ("me", "public", "nat")}
PEER = {name: ident.peer_id for name, ident in IDS.items()}
DIGESTS = {0: "ab" * 32}
GRACE_S = 2.0  # how long a missing member's notice holds the set (RoundConfig.grace_s)
TAKEOVER_S = 18.0  # a stage run's takeover delay: not what holds the set


@pytest.fixture(scope="module")
def dht() -> Iterator[hivemind.DHT]:
    """A real DHT with nothing stored: the records reach the closer through its inbox, as pushed ones do."""
    node = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    yield node
    node.shutdown()


def _closer(dht: hivemind.DHT) -> Closer:
    """A closer whose round 3 closed with "public" and "nat" as members (nat behind NAT, as its notice said), so
    round 4's turn order is agreed and "public" heads it."""
    cfg = RoundConfig(run_id=RUN, inner_steps=1, max_deadline_s=30.0, takeover_s=TAKEOVER_S, grace_s=GRACE_S)
    records = RoundRecords(dht, IDS["me"], None, cfg, None, lambda: 4)
    records.inbox.wanted = lambda key: True
    bans = RoundBans()
    no_prefetch = threading.Event()
    no_prefetch.set()  # no transport here: the payloads are not what this test is about
    payloads = Payloads(PEER["me"], None, cfg, OuterConfig(), [], [], [], bans.banned, lambda n: None, no_prefetch)
    closer = Closer(PEER["me"], cfg, 1, records, payloads, bans, lambda: Expected(3), threading.Event())
    closer.prior = (3, {PEER["public"]: frozenset({0}), PEER["nat"]: frozenset({0})})
    closer.prior_undialable = frozenset({PEER["nat"]})
    return closer


def _offer_notice(closer: Closer, name: str, dialable: bool) -> None:
    body = ContribNotice(PEER[name], 4, 100, DIGESTS, {0: 1000}, dialable=dialable).to_body(RUN)
    closer.records.inbox.offer(PEER[name], round_key(RUN, 4, KIND_CONTRIB), sign(KIND_CONTRIB, body, IDS[name]))


def _offer_set(closer: Closer) -> None:
    members = tuple((PEER[n], 100, DIGESTS) for n in sorted(("public", "nat"), key=lambda n: PEER[n]))
    body = AcceptedSet(PEER["public"], 4, members).to_body(RUN)
    closer.records.inbox.offer(PEER["public"], round_key(RUN, 4, KIND_ACCEPTED),
                               sign(KIND_ACCEPTED, body, IDS["public"]))


def test_the_set_is_taken_once_every_members_notice_is_read(dht: hivemind.DHT) -> None:
    closer = _closer(dht)
    _offer_notice(closer, "public", dialable=True)
    _offer_set(closer)  # the head's set, before the NATed member's notice reached us
    later = threading.Timer(0.5, _offer_notice, (closer, "nat", False))
    later.start()
    start = time.monotonic()
    accepted = closer.close(4)
    later.join()
    assert accepted is not None and set(accepted.senders()) == {PEER["public"], PEER["nat"]}
    assert 0.4 < time.monotonic() - start < GRACE_S
    assert closer.prior_undialable == frozenset({PEER["nat"]})  # so round 5's order ranks it last, as others do


def test_a_notice_that_never_comes_holds_the_set_for_the_grace_not_a_takeover_delay(dht: hivemind.DHT) -> None:
    closer = _closer(dht)
    _offer_notice(closer, "public", dialable=True)
    _offer_set(closer)
    start = time.monotonic()
    accepted = closer.close(4)
    assert accepted is not None and accepted.coordinator == PEER["public"]
    assert GRACE_S <= time.monotonic() - start < GRACE_S + 2.0
    assert closer.prior_undialable == frozenset()
