"""The address book a transport dials peers through: announced addresses, cached, re-read for a stranger."""

from __future__ import annotations

from dataclasses import dataclass

from hlbp.peer.net.reach import AddressBook, Reachability
from hlbp.protocol.announcement import Announcement


@dataclass
class Signed:
    announcement: Announcement


def _rec(maddr: str, reach: str = "public", online: bool = True) -> Signed:
    return Signed(Announcement(run_id="r", role="replica", reachability=reach, online=online, maddrs=(maddr,)))


def test_the_book_answers_from_its_cache_and_rereads_once_for_a_peer_it_does_not_know() -> None:
    reads: list[int] = []
    records = {"a": _rec("/ip4/198.18.0.1/tcp/1"), "gone": _rec("/ip4/198.18.0.1/tcp/2", online=False)}

    def read() -> dict[str, Signed]:
        reads.append(1)
        return dict(records)

    book = AddressBook(read, refresh_s=3600, min_reread_s=0)
    assert book.lookup("a") == (("/ip4/198.18.0.1/tcp/1",), Reachability.PUBLIC)
    assert book.maddrs("a") == ("/ip4/198.18.0.1/tcp/1",) and len(reads) == 1  # cached
    records["n"] = _rec("/ip4/10.1.0.2/tcp/3", reach="client")
    assert book.lookup("n") == (("/ip4/10.1.0.2/tcp/3",), Reachability.CLIENT) and len(reads) == 2
    assert book.lookup("gone") == ((), Reachability.UNKNOWN)  # an offline record names no address
    assert book.dialable() == ["a"]  # the NATed peer is no one to reach out to


def test_strangers_force_a_reread_at_most_once_a_second() -> None:
    reads: list[int] = []
    book = AddressBook(lambda: reads.append(1) or {}, refresh_s=3600, min_reread_s=1.0)
    for i in range(50):
        book.lookup(f"stranger-{i}")
    assert len(reads) == 1


def test_a_failed_read_keeps_what_the_book_knew() -> None:
    calls = iter([{"a": _rec("/ip4/198.18.0.1/tcp/1")}])

    def read() -> dict[str, Signed]:
        try:
            return next(calls)
        except StopIteration:
            raise ConnectionError("the DHT is gone") from None

    book = AddressBook(read, refresh_s=0)
    assert book.maddrs("a") == ("/ip4/198.18.0.1/tcp/1",)
    assert book.maddrs("a") == ("/ip4/198.18.0.1/tcp/1",)  # the re-read failed: the old entry stays


def test_the_book_names_the_stage_an_online_stage_peer_announces_and_nothing_else() -> None:
    stage = Signed(Announcement(run_id="r", role="stage", swarm=0, stage=2, maddrs=("/ip4/198.18.0.1/tcp/4",)))
    left = Signed(Announcement(run_id="r", role="stage", swarm=0, stage=1, online=False))
    book = AddressBook(lambda: {"s": stage, "left": left, "a": _rec("/ip4/198.18.0.1/tcp/1")}, min_reread_s=0)
    assert book.stage("s") == 2
    assert book.stage("left") is None and book.stage("a") is None and book.stage("stranger") is None
