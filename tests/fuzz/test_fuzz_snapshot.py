"""The structure-aware fuzzer (tests/fuzz/fuzzlib.py) on the snapshot light clients read.

A snapshot is a msgpack map of signed records, so mutations go three ways: in the outer map (types, counts,
the schema, the run), inside one record's signed body (re-signed by its author, so the deep checks run), and
as raw byte damage. :func:`decode_snapshot` may raise only ``ProtocolError``, and :func:`verify_snapshot` must
not raise at all: a bad record becomes a rejection, and what it accepts must be consistent with who signed it.
"""

from __future__ import annotations

import random
from typing import Any

import msgpack
import pytest
from families import ID_A, ID_B, NOW, RUN, SHA, Family
from fuzzlib import FAMILY_BUILDERS, run_family
from mutators import flip_bytes, mutate_tree, pack_tree
from oracles import BadAccept, mutate_sealed

from hlbp.protocol.announcement import KIND_ANNOUNCEMENT, Announcement, encode_announcement
from hlbp.protocol.identity import Identity
from hlbp.protocol.manifest import KIND_MANIFEST, Artifact, Manifest, encode_manifest
from hlbp.protocol.roundwire import KIND_ACCEPTED, KIND_CHECKS, AcceptedSet, ShardChecks, sign
from hlbp.protocol.snapshot import Snapshot, SnapshotView, decode_snapshot, encode_snapshot, verify_snapshot

INPUTS = 800
KINDS = {"manifests": KIND_MANIFEST, "peers": KIND_ANNOUNCEMENT, "checks": KIND_CHECKS, "accepted": KIND_ACCEPTED}


def _snapshot() -> Snapshot:
    manifest = Manifest(run_id=RUN, seed=7, model="tiny", tokenizer_hash=SHA, stages=((0, 2), (2, 4)),
                        artifacts=(Artifact("tokenizer.json", SHA, 123),), issued_at=NOW)

    def ann(ident: Identity, role: str) -> bytes:
        return encode_announcement(Announcement(run_id=RUN, role=role, issued_at=NOW, expires_at=NOW + 60,
                                                manifest_signer=ID_A.peer_id, maddrs=("/ip4/127.0.0.1/tcp/1",)),
                                   ident)

    members = tuple(sorted([(ID_A.peer_id, 10, {0: SHA}), (ID_B.peer_id, 20, {0: SHA})]))
    return Snapshot(RUN, NOW, {ID_A.peer_id: encode_manifest(manifest, ID_A)},
                    {ID_A.peer_id: ann(ID_A, "bootstrap"), ID_B.peer_id: ann(ID_B, "replica")},
                    {ID_B.peer_id: sign(KIND_CHECKS, ShardChecks(ID_B.peer_id, 5, {0: SHA}).to_body(RUN), ID_B)},
                    5, {ID_B.peer_id: sign(KIND_ACCEPTED, AcceptedSet(ID_B.peer_id, 5, members).to_body(RUN), ID_B)})


def _check(data: bytes, view: SnapshotView) -> None:
    """What an accepted view must satisfy, whatever the input: a trusted manifest, and records of its run filed
    under their signers."""
    if view.manifest is None:
        if view.peers or view.checks or view.accepted:
            raise BadAccept("records accepted without a trusted manifest")
        return
    run_id = view.manifest.manifest.run_id
    if view.manifest.signer != ID_A.peer_id:
        raise BadAccept(f"manifest of untrusted signer {view.manifest.signer}")
    for peer_id, rec in view.peers.items():
        if rec.peer_id != peer_id or rec.announcement.run_id != run_id:
            raise BadAccept(f"announcement of {rec.peer_id} for {rec.announcement.run_id} filed under {peer_id}")
    if any(c.round != view.accepted_round for c in view.accepted if view.accepted_round is not None):
        raise BadAccept("an accepted set of another round")
    if any(not isinstance(r.reason, str) for r in view.rejected):
        raise BadAccept("a rejection without a reason")


def _snapshot_family() -> Family:
    seed = encode_snapshot(_snapshot())
    authors = {ID_A.peer_id: ID_A, ID_B.peer_id: ID_B}

    def make(rng: random.Random) -> bytes:
        r = rng.random()
        if r < 0.35:
            return pack_tree(mutate_tree(rng, msgpack.unpackb(seed, raw=False), n=rng.choice([1, 2])))
        if r < 0.85:
            body = msgpack.unpackb(seed, raw=False)
            section = rng.choice(list(KINDS))
            author = rng.choice(list(body[section]))
            body[section][author] = mutate_sealed(rng, body[section][author], KINDS[section], authors[author])
            return msgpack.packb(body, use_bin_type=True)
        return flip_bytes(rng, seed)

    def decode(data: bytes) -> SnapshotView:
        snap = decode_snapshot(data)
        return verify_snapshot(snap, {ID_A.peer_id}, False, NOW + 1)  # never raises: failures are rejections

    return Family("snapshot", make, decode, honest=[seed], check=_check)


def test_snapshot_decoding_and_verification_keep_their_contract(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(FAMILY_BUILDERS, "snapshot", _snapshot_family)
    report = run_family("snapshot", INPUTS, seed=1234)
    assert report.inputs == INPUTS
    assert report.ok, "\n\n".join(report.findings)
    assert report.rejected > 0 and report.accepted > 0


def test_the_honest_snapshot_verifies_whole() -> None:
    view: Any = _snapshot_family().decode(encode_snapshot(_snapshot()))
    assert view.rejected == [] and len(view.peers) == 2 and len(view.checks) == 1 and len(view.accepted) == 1
