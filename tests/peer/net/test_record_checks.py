"""The DHT validator, the record reader and manifest trust, in process and without a network."""

from __future__ import annotations

import logging
import stat

import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer

from hlbp.peer.common.errors import UserInputError
from hlbp.peer.net.control import check_initial_peers
from hlbp.peer.net.validation import (
    RecordReader,
    choose_manifest,
    dht_time,
    load_or_create_identity,
    record_validator,
)
from hlbp.protocol.announcement import Announcement, encode_announcement, peers_key
from hlbp.protocol.identity import Identity, seal
from hlbp.protocol.manifest import KIND_MANIFEST, MANIFEST_KEY, Manifest, decode_manifest, encode_manifest

SHA = "cd" * 32


def _ann(now: float, **changes) -> Announcement:
    return Announcement(**{"run_id": "r", "role": "replica", "issued_at": now, "expires_at": now + 30, **changes})


def _dht_record(key: str, subkey, value, expiration: float) -> DHTRecord:
    return DHTRecord(DHTID.generate(source=key).to_bytes(), MSGPackSerializer.dumps(subkey),
                     MSGPackSerializer.dumps(value), expiration)


def test_validator_accepts_owned_records_and_refuses_forgeries_logging_each_once(caplog):
    owner, forger = Identity.generate(), Identity.generate()
    now = dht_time()
    validator = record_validator(("r",))
    good = encode_announcement(_ann(now), owner)
    assert validator.validate(_dht_record(peers_key("r"), owner.peer_id, good, now + 30))
    assert validator.validate(_dht_record("someone-elses-key", "x", b"anything", now + 30))  # not ours: untouched

    forged = _dht_record(peers_key("r"), owner.peer_id, encode_announcement(_ann(now), forger), now + 30)
    garbage = _dht_record(peers_key("r"), "x", b"\xc1garbage", now + 30)
    outliving = _dht_record(peers_key("r"), owner.peer_id, good, now + 3600)  # replayed with a longer life
    not_a_peer_subkey = _dht_record(peers_key("r"), 17, good, now + 30)
    with caplog.at_level(logging.WARNING, logger="hlbp.peer.net.control"):
        for _ in range(3):
            for record in (forged, garbage, outliving, not_a_peer_subkey):
                assert not validator.validate(record)
    refusals = [r for r in caplog.records if "DHT refused" in r.getMessage()]
    assert len(refusals) == 4  # four bad records, three reads each, one line each


def test_validator_protects_the_manifest_and_merges_run_keys():
    signer = Identity.generate()
    validator = record_validator()
    m = Manifest(run_id="r", seed=0, model="tiny", tokenizer_hash=SHA, stages=((0, 4),), issued_at=1.0)
    data = encode_manifest(m, signer)
    now = dht_time()
    assert validator.validate(_dht_record(MANIFEST_KEY, signer.peer_id, data, now + 60))
    assert not validator.validate(_dht_record(MANIFEST_KEY, Identity.generate().peer_id, data, now + 60))
    assert not validator.validate(_dht_record(MANIFEST_KEY, signer.peer_id, data, now + 10 * 86400))
    # A newer protocol's manifest still passes the DHT, so the joiner can explain why it refuses it.
    v2 = seal(KIND_MANIFEST, {**m.to_body(), "proto": 2}, signer)
    assert validator.validate(_dht_record(MANIFEST_KEY, signer.peer_id, v2, now + 60))
    bad_peer_record = _dht_record(peers_key("later"), "x", b"junk", now + 30)
    assert validator.validate(bad_peer_record)  # run not watched yet
    assert validator.merge_with(record_validator(("later",)))
    assert not validator.validate(bad_peer_record)


def test_reader_skips_bad_entries_logs_once_and_keeps_offline_peers(caplog):
    a, b, c, d = Identity.generate(), Identity.generate(), Identity.generate(), Identity.generate()
    now = dht_time()
    entries = {
        a.peer_id: encode_announcement(_ann(now), a),
        b.peer_id: encode_announcement(_ann(now, online=False), b),
        c.peer_id: encode_announcement(_ann(now), a),  # signed by a, stored under c
        "junk": b"junk",
        d.peer_id: encode_announcement(_ann(now - 100), d),  # well signed, expired: dropped quietly
        "other-run": encode_announcement(_ann(now, run_id="q"), c),
    }
    reader = RecordReader()
    with caplog.at_level(logging.WARNING, logger="hlbp.peer.net.control"):
        for _ in range(5):
            found = reader.announcements(entries, "r", now)
            assert set(found) == {a.peer_id, b.peer_id}
            assert not found[b.peer_id].announcement.online
    # three bad entries (forged, junk, other run), each logged once; expiry is not an error
    assert len([r for r in caplog.records if "ignoring a peer record" in r.getMessage()]) == 3


def test_manifest_trust_picks_the_newest_from_a_trusted_signer():
    boot, stranger = Identity.generate(), Identity.generate()

    def signed(identity: Identity, issued: float):
        m = Manifest(run_id="r", seed=0, model="tiny", tokenizer_hash=SHA, stages=((0, 4),), issued_at=issued)
        return decode_manifest(encode_manifest(m, identity))

    old, new, evil = signed(boot, 1.0), signed(boot, 2.0), signed(stranger, 9.0)
    assert choose_manifest([old, evil, new], {boot.peer_id}) is new
    assert choose_manifest([evil], {boot.peer_id}) is None


def test_identity_file_is_created_read_only_and_reloaded(tmp_path):
    path = tmp_path / "sub" / "id.key"
    first = load_or_create_identity(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o400
    assert load_or_create_identity(path).peer_id == first.peer_id
    rsa_like = tmp_path / "rsa.key"
    rsa_like.write_bytes(b"\x08\x00\x12\x05hello")
    with pytest.raises(UserInputError, match="Ed25519"):
        load_or_create_identity(rsa_like)


def test_initial_peers_typos_fail_fast():
    ok = "/ip4/127.0.0.1/tcp/4001/p2p/" + Identity.generate().peer_id
    assert check_initial_peers([ok, " "]) == [ok]
    for bad in ("127.0.0.1:4001", "/ip4/127.0.0.1/tcp/4001", "/ip4/999.1.1.1/tcp/1/p2p/x"):
        with pytest.raises(UserInputError, match="full multiaddr"):
            check_initial_peers([bad])


def test_extra_keys_such_as_round_records_are_protected_too():
    owner, forger = Identity.generate(), Identity.generate()
    validator = record_validator(extra={"hlbp:r:round:3:contrib": ("contrib", 1024)})
    now = dht_time()
    good = seal("contrib", {"run": "r", "round": 3}, owner)
    assert validator.validate(_dht_record("hlbp:r:round:3:contrib", owner.peer_id, good, now + 30))
    assert not validator.validate(_dht_record("hlbp:r:round:3:contrib", forger.peer_id, good, now + 30))
    assert not validator.validate(_dht_record("hlbp:r:round:3:contrib", owner.peer_id,
                                              seal("contrib", {"pad": "x" * 2000}, owner), now + 30))
