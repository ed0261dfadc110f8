"""Blobs made on request (``put_lazy``): a shard's state is served from tensors the peer holds, not kept as bytes.

Real DHTs and p2pd daemons on 127.0.0.1. The maker runs when a request comes (not before), concurrent requests
share one making, and a maker that has nothing (None) or fails is a "not here" to the requester, never the end of
the serving peer's transport. ``ServedState`` gives the state blob of a round while its tensors live and None
once a later round has replaced and dropped them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from control_helpers import transport_pair

from hlbp.peer.net.blobstore import MAX_READERS, BlobStore
from hlbp.peer.net.transport import P2PBlobTransport, TransportError
from hlbp.peer.rounds.anchor import Anchor
from hlbp.peer.rounds.statesync import ServedState, encode_state, parse_state


def test_the_store_serves_a_lazy_name_until_it_is_dropped_or_put_as_bytes() -> None:
    store = BlobStore()
    store.put_lazy("s/1/0", lambda: b"made")
    data, shared, make = store.lookup("s/1/0")
    assert data is None and not shared and make is not None and make() == b"made"
    assert store.names() == ["s/1/0"]
    store.put("s/1/0", b"held")
    assert store.lookup("s/1/0") == (b"held", False, None)
    store.put_lazy("s/2/0", lambda: None)
    store.drop_prefix("s/")
    assert store.names() == [] and store.lookup("s/2/0") == (None, False, None)


def test_the_store_remembers_whom_a_held_blob_was_sent_to_until_it_changes() -> None:
    store = BlobStore()
    store.put("m/1", b"ours")
    store.note_read("m/1", "peerA")
    store.note_read("m/1", "peerA")
    store.note_read("absent", "peerB")  # not held: nothing to remember
    store.put_lazy("lazy", lambda: b"made")
    store.note_read("lazy", "peerB")  # made on request: not remembered (its requesters are many)
    assert store.readers("m/1") == {"peerA"} and store.readers("absent") == set() == store.readers("lazy")
    for i in range(MAX_READERS + 10):  # requesters are untrusted: a flood of names is bounded
        store.note_read("m/1", f"p{i}")
    assert len(store.readers("m/1")) == MAX_READERS
    store.put("m/1", b"new bytes")  # a new blob under the name: nobody has it yet
    assert store.readers("m/1") == set()
    store.note_read("m/1", "peerA")
    store.drop(["m/1"])
    assert store.readers("m/1") == set()


@pytest.mark.parametrize("on_disk", [False, True], ids=["memory", "disk"])
def test_served_state_lives_as_long_as_the_rounds_tensors(tmp_path, on_disk: bool) -> None:
    """A round's shard state is served from the anchor until a later round writes one of the shard's parameters;
    another shard's state stays served."""
    anchor = Anchor({"a": torch.arange(6, dtype=torch.float32).view(2, 3), "b": torch.ones(4), "c": torch.zeros(2)},
                    spill_dir=str(tmp_path) if on_disk else "")
    served = ServedState(anchor, ["a", "b"], {"ef.a": torch.zeros(2, 3)})  # error feedback is never served
    other = ServedState(anchor, ["c"], {})
    blob = served()
    assert blob == encode_state(anchor, ["a", "b"], {})
    state = parse_state(blob, {"a": (2, 3), "b": (4,)})
    assert torch.equal(state.params["a"], torch.arange(6, dtype=torch.float32).view(2, 3)) and state.outer == {}
    anchor["a"] = anchor["a"] + 1  # the next round replaces the tensor
    assert served() is None
    assert other() == encode_state({"c": torch.zeros(2)}, ["c"], {})


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[P2PBlobTransport, P2PBlobTransport]]:
    with transport_pair() as both:
        yield both


@pytest.mark.slow
def test_a_lazy_blob_is_made_on_request_once_for_overlapping_requests(pair) -> None:
    holder, asker = pair
    calls: list[float] = []
    gate = threading.Event()

    def make() -> bytes:
        calls.append(time.monotonic())
        gate.wait(5)  # both requests arrive while the first making is under way
        return b"x" * 100_000

    holder.put_lazy("lazy", make)
    assert calls == []  # nothing is made before a request
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(asker.fetch, holder.peer_id, "lazy", 1 << 20, 10.0) for _ in range(2)]
        deadline = time.monotonic() + 10
        while not calls and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        gate.set()
        assert [f.result(timeout=15) for f in futures] == [b"x" * 100_000] * 2
    assert len(calls) == 1
    assert asker.fetch(holder.peer_id, "lazy", 1 << 20, 10.0) == b"x" * 100_000  # made again for a later one
    assert len(calls) == 2


@pytest.mark.slow
def test_a_maker_with_nothing_or_failing_is_not_here_and_the_transport_goes_on(pair) -> None:
    holder, asker = pair

    def broken() -> bytes:
        raise RuntimeError("the tensors are gone")

    holder.put_lazy("gone", lambda: None)
    holder.put_lazy("broken", broken)
    for name in ("gone", "broken"):
        with pytest.raises(TransportError, match="has no"):
            asker.fetch(holder.peer_id, name, 1 << 20, 10.0)
    holder.put("plain", b"still serving")
    assert asker.fetch(holder.peer_id, "plain", 1 << 20, 10.0) == b"still serving"


@pytest.mark.slow
def test_the_holder_knows_who_was_sent_a_blob(pair) -> None:
    holder, asker = pair
    holder.put("ours/1", b"message")
    assert holder.readers("ours/1") == set()
    with pytest.raises(TransportError, match="has no"):
        asker.fetch(holder.peer_id, "ours/2", 1 << 20, 10.0)
    assert asker.fetch(holder.peer_id, "ours/1", 1 << 20, 10.0) == b"message"
    deadline = time.monotonic() + 10  # the holder notes it after its write, on its own event loop
    while holder.readers("ours/1") != {asker.peer_id} and time.monotonic() < deadline:
        time.sleep(0.05)
    assert holder.readers("ours/1") == {asker.peer_id} and holder.readers("ours/2") == set()
