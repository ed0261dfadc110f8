"""Bundles of others' signed records (protocol/bundle.py): exact round trips and hostile bytes refused."""

from __future__ import annotations

import msgpack
import pytest

from hlbp.protocol import ProtocolError
from hlbp.protocol.bundle import MAX_BUNDLE_BYTES, pack_bundles, parse_bundle

PEER = "12D3KooW" + "A" * 44


def test_records_round_trip_exactly_and_split_to_fit_a_push() -> None:
    records = [("contrib", PEER, bytes([i % 256]) * 400) for i in range(300)]
    packed = pack_bundles(7, records, complete=True)
    assert len(packed) > 1 and all(len(b) <= MAX_BUNDLE_BYTES for b in packed)
    back = [rec for b in packed for rec in parse_bundle(b, 7).records]
    assert back == records
    assert all(parse_bundle(b, 7).complete for b in packed)
    empty = pack_bundles(3, [], complete=False)
    assert len(empty) == 1 and parse_bundle(empty[0], 3).records == () and not parse_bundle(empty[0], 3).complete


@pytest.mark.parametrize("body", [
    {"round": 8, "complete": True, "records": []},  # another round
    {"round": 7, "complete": 1, "records": []},
    {"round": 7, "complete": True, "records": [["checks", PEER, b"x"]]},  # a kind a bundle does not carry
    {"round": 7, "complete": True, "records": [["contrib", "not a peer", b"x"]]},
    {"round": 7, "complete": True, "records": [["contrib", PEER, "text"]]},
    {"round": 7, "complete": True, "records": [["contrib", PEER]]},
    {"round": 7, "complete": True},
    {"round": 7, "complete": True, "records": [], "extra": 1},
    [7, True, []],
])
def test_malformed_bundles_raise_protocol_error(body: object) -> None:
    with pytest.raises(ProtocolError):
        parse_bundle(msgpack.packb(body, use_bin_type=True), 7)


@pytest.mark.parametrize("data", [b"", b"\xc1", b"\xdd\xff\xff\xff\xff", b"x" * (MAX_BUNDLE_BYTES + 1), "text", None])
def test_garbage_and_oversized_bytes_raise_protocol_error(data: object) -> None:
    with pytest.raises(ProtocolError):
        parse_bundle(data, 7)


def test_a_record_too_big_for_any_bundle_is_refused_when_packing() -> None:
    with pytest.raises(ValueError):
        pack_bundles(1, [("accepted", PEER, b"x" * MAX_BUNDLE_BYTES)], complete=True)
