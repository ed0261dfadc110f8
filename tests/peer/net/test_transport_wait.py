"""A holder asked for a blob it is still fetching from the source waits for it instead of answering "not here".

Real DHTs and p2pd daemons on 127.0.0.1: a requester asks a holder for a name while the holder is inside
``sharing(name)`` (its fetch from the source under way). The answer waits for the holder's ``put``, is "not here"
as soon as the sharing ends without one, is "not here" after ``hold_s`` at the latest, and the number of waiting
requests is capped.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from control_helpers import transport_pair

from hlbp.peer.net import answers
from hlbp.peer.net.transport import P2PBlobTransport, TransportError
from hlbp.peer.sim.launcher import poll

pytestmark = pytest.mark.slow

BLOB = bytes(range(256)) * 64


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[P2PBlobTransport, P2PBlobTransport]]:
    with transport_pair(hold_s=3.0) as both:
        yield both


def _ask(asker: P2PBlobTransport, holder: P2PBlobTransport, name: str, pool: ThreadPoolExecutor) -> Any:
    return pool.submit(asker.fetch, holder.peer_id, name, 1 << 20, 10.0)


def _outcome(future: Any) -> tuple[bytes | str, float]:
    t0 = time.monotonic()
    try:
        return future.result(timeout=15), time.monotonic() - t0
    except TransportError as exc:
        return str(exc), time.monotonic() - t0


def test_a_request_waits_for_the_holders_fetch_and_gets_the_blob(pair) -> None:
    holder, asker = pair
    with pytest.raises(TransportError, match="has no"):  # not fetching it: "not here" at once, as before
        asker.fetch(holder.peer_id, "a", 1 << 20, 10.0)
    with ThreadPoolExecutor(2) as pool, holder.sharing("a"):
        pending = _ask(asker, holder, "a", pool)
        poll(lambda: holder.answers.waiting == 1, 20, "the request to wait at the holder")
        holder.put("a", BLOB)
        got, _ = _outcome(pending)
    assert got == BLOB


def test_a_fetch_that_ends_without_the_blob_releases_the_request_at_once(pair) -> None:
    holder, asker = pair
    with ThreadPoolExecutor(2) as pool:
        with holder.sharing("b"):
            pending = _ask(asker, holder, "b", pool)
            poll(lambda: holder.answers.waiting == 1, 20, "the request to wait at the holder")
        got, waited = _outcome(pending)
    assert isinstance(got, str) and "has no b" in got and waited < holder.hold_s, (got, waited)


def test_a_request_waits_at_most_hold_s_and_waiters_are_capped(pair, monkeypatch) -> None:
    holder, asker = pair
    monkeypatch.setattr(answers, "MAX_WAITERS", 1)
    with ThreadPoolExecutor(3) as pool, holder.sharing("c"):
        t0 = time.monotonic()
        first = _ask(asker, holder, "c", pool)
        poll(lambda: holder.answers.waiting == 1, 20, "the first request to wait at the holder")
        second, waited = _outcome(_ask(asker, holder, "c", pool))  # over the cap: "not here" without waiting
        assert isinstance(second, str) and "has no c" in second and waited < 1.0, (second, waited)
        got, _ = _outcome(first)
        elapsed = time.monotonic() - t0
    assert isinstance(got, str) and "has no c" in got, got
    assert holder.hold_s - 0.5 <= elapsed < holder.hold_s + 3.0, elapsed
    assert holder.answers.waiting == 0
