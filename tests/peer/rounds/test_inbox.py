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
