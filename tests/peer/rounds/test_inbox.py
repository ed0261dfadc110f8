"""The inbox of pushed round records keeps only what the runner wants, within bounds, and wakes its waiter."""

from __future__ import annotations

import threading
import time

from hlbp.peer.rounds.inbox import Inbox


def _inbox(**kw: int) -> Inbox:
    box = Inbox(max_record_bytes=100, **kw)
    box.wanted = lambda key: key.startswith("want")
    return box


def test_only_wanted_keys_within_bounds_are_kept() -> None:
    box = _inbox(max_senders=2, max_bytes_per_key=150)
    assert not box.offer("p", "other", b"x")  # a key the runner does not want now
    assert not box.offer("p", "want", b"x" * 101)  # a record over the size limit
    assert box.offer("p", "want", b"a" * 60) and box.offer("q", "want", b"b" * 60)
    assert not box.offer("r", "want", b"c")  # a third sender: the key is full
    assert not box.offer("p", "want", b"a" * 95)  # the key's bytes would pass 150
    assert box.offer("p", "want", b"new")  # a sender's newer record replaces its old one
    assert box.entries("want") == {"p": b"new", "q": b"b" * 60}
    assert box.refused == 4


def test_wait_wakes_for_a_record_and_prune_drops_unwanted_keys() -> None:
    box = _inbox()
    assert not box.wait(0.0)
    threading.Timer(0.05, lambda: box.offer("p", "want1", b"x")).start()
    t0 = time.monotonic()
    assert box.wait(10.0) and time.monotonic() - t0 < 5.0
    assert not box.wait(0.0)  # consumed
    box.offer("p", "want2", b"y")
    box.wanted = lambda key: key == "want2"
    box.prune()
    assert box.entries("want1") == {} and box.entries("want2") == {"p": b"y"}
    assert box.arrived("want1") == {}  # its landing times go with it


def test_arrived_notes_when_each_record_landed() -> None:
    box = _inbox()
    t0 = time.monotonic()
    box.offer("p", "want", b"x")
    box.offer("q", "other", b"x")  # refused: no time kept
    landed = box.arrived("want")
    assert set(landed) == {"p"} and t0 <= landed["p"] <= time.monotonic()
    assert box.arrived("other") == {}
    box.offer("p", "want", b"x")  # the same bytes again keep the first landing
    assert box.arrived("want") == landed


def test_a_stale_push_never_hides_the_newer_dht_record_and_a_newer_push_wins() -> None:
    """A sender that stopped pushing to us (it no longer sees us live) leaves an old record in the inbox while the
    DHT moves on: the reader must take the later round of the two, whichever copy holds it."""
    from hlbp.peer.rounds.inbox import Both, merge
    from hlbp.peer.rounds.records import _newer
    from hlbp.protocol.identity import Identity
    from hlbp.protocol.roundwire import KIND_CHECKS, ShardChecks, parse_checks, sign

    me = Identity.generate()

    def record(r: int) -> bytes:
        return sign(KIND_CHECKS, ShardChecks(me.peer_id, r, {0: "ab" * 32}).to_body("run"), me)

    old, new = record(3), record(11)
    merged = merge({me.peer_id: new}, {me.peer_id: old})
    assert merged == {me.peer_id: Both(new, old)}
    assert _newer(parse_checks, merged[me.peer_id], me.peer_id, "run").round == 11
    assert _newer(parse_checks, Both(old, new), me.peer_id, "run").round == 11
    assert _newer(parse_checks, Both(b"garbage", new), me.peer_id, "run").round == 11  # a bad copy is skipped
    assert merge({me.peer_id: new}, {me.peer_id: new}) == {me.peer_id: new}  # the same bytes: no conflict
