"""Stage-stream messages: exact round trips, and every defect of an untrusted message is one ProtocolError."""

from __future__ import annotations

import random

import msgpack
import pytest
import torch

from hlbp.protocol import ProtocolError
from hlbp.protocol.activations import encode_activations
from hlbp.protocol.stagewire import (
    LENGTH,
    MAX_HEADER,
    StageMessage,
    decode_message,
    decode_targets,
    decode_tokens,
    encode_message,
    encode_tokens,
    header_map,
    split_body,
)


def test_round_trip_keeps_every_field_and_the_body() -> None:
    msg = StageMessage("fwd", session=7, step=3, mb=2, attempt=1, route=("12D3KooWabc", "12D3KooWdef"), weight=0.25)
    data = encode_message(msg, b"body")
    assert decode_message(data, 4) == (msg, b"body")
    done = StageMessage("done", session=7, step=3, sumsq=4.5, scale=0.5, lr=1e-3, opt_step=9)
    assert decode_message(encode_message(done), 0) == (done, b"")
    assert set(header_map(done)) == {"op", "session", "step", "sumsq", "scale", "lr", "opt_step"}  # defaults stay off


def test_the_token_window_round_trips_and_splits() -> None:
    x = torch.randn(2, 3, 8)
    stream = torch.randint(0, 500, (2, 4))
    inputs, y = stream[:, :-1], stream[:, 1:]
    frame = encode_activations(x, "forward", "fp32")
    body = frame + encode_tokens(inputs, y, 500)
    got_frame, got_window = split_body(body, 500)
    assert got_frame == frame and len(got_window) == 2 * 4 * 2  # u16 ids: each row's first input, its targets
    assert torch.equal(decode_targets(got_window, (2, 3), 500), y)
    assert torch.equal(decode_tokens(got_window, (2, 3), 500), stream)  # the inputs are its first 3 columns
    big = encode_tokens(inputs, y, 70_000)  # a vocabulary past u16: u32 ids
    assert len(big) == 2 * 4 * 4 and torch.equal(decode_tokens(big, (2, 3), 70_000), stream)


@pytest.mark.parametrize("header", [
    {"op": "explode"},
    {"op": "fwd", "mb": -1},
    {"op": "fwd", "mb": 1 << 20},
    {"op": "fwd", "weight": 2.0},
    {"op": "fwd", "weight": float("nan")},
    {"op": "done", "scale": 1.5},
    {"op": "fwd", "route": ["not base58 0OIl"]},
    {"op": "fwd", "route": ["12D3KooW"] * 33},
    {"op": "fwd", "extra": 1},
    {"op": "bwd", "busy": [-1.0]},
    {"op": "fail", "peer": "x" * 200},
    ["op", "fwd"],
])
def test_bad_headers_are_refused(header: object) -> None:
    head = msgpack.packb(header, use_bin_type=True)
    with pytest.raises(ProtocolError):
        decode_message(LENGTH.pack(len(head)) + head + LENGTH.pack(0), 0)


def test_sizes_are_checked_before_anything_is_read() -> None:
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        decode_message(LENGTH.pack(MAX_HEADER + 1) + b"\0" * 8, 0)
    with pytest.raises(ProtocolError, match="body"):
        decode_message(encode_message(StageMessage("fwd"), b"x" * 10), 9)
    with pytest.raises(ProtocolError, match="body"):  # a control message carries no body
        decode_message(encode_message(StageMessage("ping"), b"x"), 100)
    with pytest.raises(ProtocolError):
        decode_message(encode_message(StageMessage("fwd"), b"x" * 10)[:-1], 100)


def test_targets_outside_the_vocabulary_or_of_the_wrong_length_are_refused() -> None:
    with pytest.raises(ProtocolError, match="vocabulary"):
        decode_targets(encode_tokens(torch.tensor([[7, 3]]), torch.tensor([[3, 600]]), 1000), (1, 2), 500)
    with pytest.raises(ProtocolError, match="vocabulary"):  # the first input id is checked like a target
        decode_tokens(encode_tokens(torch.tensor([[600, 3]]), torch.tensor([[3, 4]]), 1000), (1, 2), 500)
    with pytest.raises(ProtocolError, match="token window"):
        decode_targets(b"\0" * 4, (1, 2), 500)  # the targets alone, without the first input id
    with pytest.raises(ProtocolError):
        split_body(b"\0" * 10, 500)


def test_structured_fuzz_only_raises_protocol_error() -> None:
    """Mutate inside the msgpack header (re-encoded canonically) and inside the frame and targets."""
    rng = random.Random(0)
    base = {"op": "fwd", "session": 5, "step": 1, "mb": 0, "attempt": 0, "route": ["12D3KooWabc"], "weight": 0.5}
    body = encode_activations(torch.randn(2, 4, 8), "forward", "fp32") + encode_tokens(torch.zeros(2, 4), torch.zeros(2, 4), 100)
    values = [0, -1, 2**64 - 1, -(2**63), 1.5, float("inf"), "", "x" * 300, b"\0", [], {}, None, True, ["12D3KooWabc"] * 40]
    for _ in range(2000):
        header = dict(base)
        key = rng.choice([*base, "count", "sumsq", "peer", "busy", "code", "bogus"])
        header[key] = rng.choice(values)
        head = msgpack.packb(header, use_bin_type=True)
        raw = bytearray(body)
        for _ in range(rng.randint(0, 4)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        data = LENGTH.pack(len(head)) + head + LENGTH.pack(len(raw)) + bytes(raw)
        try:
            msg, got = decode_message(data, 4096)
            frame, targets = split_body(got, 100)
        except ProtocolError:
            continue
        assert msg.op == "fwd" and len(frame) + len(targets) == len(raw)


def test_round_end_and_tokens_travel_and_are_bounded() -> None:
    import msgpack
    import pytest as _pytest

    from hlbp.protocol import ProtocolError
    from hlbp.protocol.stagewire import StageMessage, decode_header, encode_message, parse_header

    msg = StageMessage("finish", session=1, step=2, count=4, tokens=256, round_end=True)
    data = encode_message(msg)
    assert decode_header(data[4:4 + int.from_bytes(data[:4], "big")]) == msg
    for bad in ({"op": "done", "tokens": -1}, {"op": "done", "tokens": 1 << 41}, {"op": "done", "round_end": 1}):
        with _pytest.raises(ProtocolError):
            parse_header(msgpack.unpackb(msgpack.packb(bad)))


def test_reason_codes_travel_as_integers_and_an_unknown_one_is_refused() -> None:
    from hlbp.protocol.stagewire import Reason

    for code in Reason:
        msg = StageMessage("fail", session=1, step=2, peer="12D3KooWabc", code=code, reason="text for the log")
        got, _ = decode_message(encode_message(msg), 0)
        assert got == msg and type(got.code) is Reason
    assert header_map(StageMessage("pong", code=Reason.ROUND)) == {"op": "pong", "code": 1}
    assert "code" not in header_map(StageMessage("pong"))
    for bad in (max(Reason) + 1, 255, 256, -1, "already applied", 1.0, True):
        head = msgpack.packb({"op": "fail", "code": bad}, use_bin_type=True)
        with pytest.raises(ProtocolError):
            decode_message(LENGTH.pack(len(head)) + head + LENGTH.pack(0), 0)


def test_a_finish_names_the_peers_beside_its_route_and_a_share_carries_its_lineage_and_body() -> None:
    finish = StageMessage("finish", session=1, step=2, count=8, route=("12D3KooWb",), peers=("12D3KooWq",),
                          per=(1, 0))
    assert decode_message(encode_message(finish), 0) == (finish, b"")
    share = StageMessage("share", session=1, step=2, count=8, peers=("12D3KooWp", "12D3KooWq"), lineage=b"\x01" * 32)
    data = encode_message(share, b"x" * 100)
    assert decode_message(data, 0, 100) == (share, b"x" * 100)
    with pytest.raises(ProtocolError):
        decode_message(data, 10_000, 99)  # a share's body has its own limit, not the frames'


@pytest.mark.parametrize("fields", [
    {"peers": ["12D3KooWq"], "per": [2]},  # the counts do not add up
    {"peers": ["12D3KooWq"], "per": [9]},  # more peers on a stage than may serve one
    {"peers": "12D3KooWq"},
    {"peers": ["not a peer id!"], "per": [1]},
    {"lineage": b"\x00" * 31},
    {"lineage": "text"},
])
def test_bad_peer_lists_and_lineages_are_refused(fields: dict) -> None:
    head = msgpack.packb({"op": "share", **fields}, use_bin_type=True)
    with pytest.raises(ProtocolError):
        decode_message(LENGTH.pack(len(head)) + head + LENGTH.pack(0), 0)
