"""Peer identities and signed envelopes: Ed25519 keys that are also libp2p (p2pd) identities.

A peer id is the base58 "identity" multihash of its Ed25519 public key, so a verifier needs nothing but the peer id
to check a signature, and the key that signs a peer's records is the one p2pd authenticates its connections with.
An envelope (magic, schema, kind, signer, msgpack body, signature) binds a record body to its signer. Pure
functions over bytes; every decoder raises :class:`ProtocolError` and nothing else on bad input.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from hlbp.protocol.errors import ProtocolError
from hlbp.protocol.untrusted import preview, unpack_msgpack

ENVELOPE_MAGIC = b"hlbp"
ENVELOPE_SCHEMA = 1  # layout of the envelope itself, independent of the body schemas
_B58_ALPHABET = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_B58_INDEX = {ch: i for i, ch in enumerate(_B58_ALPHABET)}
# libp2p key protobufs, hand-encoded so that this module needs no protobuf runtime:
# PublicKey{Type: Ed25519 (1), Data: 32 bytes} and PrivateKey{Type: Ed25519, Data: seed || public key}.
_ED25519_PUBLIC_PB_PREFIX = b"\x08\x01\x12\x20"
_ED25519_PRIVATE_PB_PREFIX = b"\x08\x01\x12\x40"
_IDENTITY_MULTIHASH_PREFIX = b"\x00\x24"  # multihash code 0x00 (identity), length 36


def sha256_hex(data: bytes) -> str:
    """Content hash used for artifacts and record digests."""
    return hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------------------------------------------------------
# Peer identity: Ed25519 keys whose libp2p peer id embeds the public key
# ---------------------------------------------------------------------------------------------------------------


def b58encode(data: bytes) -> str:
    """Bitcoin-alphabet base58, the text form of libp2p peer ids."""
    number = int.from_bytes(data, "big")
    digits = []
    while number:
        number, rem = divmod(number, 58)
        digits.append(_B58_ALPHABET[rem])
    zeros = len(data) - len(data.lstrip(b"\0"))
    return "1" * zeros + "".join(reversed(digits))


def b58decode(text: str, max_len: int = 128) -> bytes:
    """Inverse of :func:`b58encode`; rejects foreign characters and over-long input."""
    if not isinstance(text, str) or not text or len(text) > max_len:
        raise ProtocolError(f"a base58 string of 1..{max_len} characters was expected")
    number = 0
    for ch in text:
        digit = _B58_INDEX.get(ch)
        if digit is None:
            raise ProtocolError(f"{ch!r} is not a base58 character")
        number = number * 58 + digit
    zeros = len(text) - len(text.lstrip("1"))
    return b"\0" * zeros + number.to_bytes((number.bit_length() + 7) // 8, "big")


def peer_id_from_public_key(public_key: bytes) -> str:
    """The libp2p peer id (base58, ``12D3KooW...``) of a raw 32-byte Ed25519 public key."""
    if len(public_key) != 32:
        raise ProtocolError("an Ed25519 public key has 32 bytes")
    return b58encode(_IDENTITY_MULTIHASH_PREFIX + _ED25519_PUBLIC_PB_PREFIX + public_key)


def public_key_from_peer_id(peer_id: str) -> bytes:
    """The raw Ed25519 public key inside a peer id; peer ids of other key types cannot sign hlbp records."""
    raw = b58decode(peer_id)
    prefix = _IDENTITY_MULTIHASH_PREFIX + _ED25519_PUBLIC_PB_PREFIX
    if len(raw) != len(prefix) + 32 or not raw.startswith(prefix):
        raise ProtocolError(f"peer id {peer_id[:60]!r} is not an Ed25519 identity peer id")
    return raw[len(prefix) :]


class Identity:
    """An Ed25519 private key: the peer's libp2p transport identity and its record-signing key at once."""

    def __init__(self, seed: bytes) -> None:
        if len(seed) != 32:
            raise ProtocolError("an Ed25519 private key seed has 32 bytes")
        self._key = Ed25519PrivateKey.from_private_bytes(seed)
        self.public_key = self._key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.peer_id = peer_id_from_public_key(self.public_key)

    @classmethod
    def generate(cls) -> Identity:
        key = Ed25519PrivateKey.generate()
        return cls(key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                     serialization.NoEncryption()))

    @classmethod
    def from_file_bytes(cls, data: bytes) -> Identity:
        """Parse a libp2p ``PrivateKey`` protobuf as p2pd reads it from its ``-id`` file (Ed25519 only)."""
        if len(data) != len(_ED25519_PRIVATE_PB_PREFIX) + 64 or not data.startswith(_ED25519_PRIVATE_PB_PREFIX):
            raise ProtocolError("the identity file does not hold an Ed25519 libp2p private key")
        body = data[len(_ED25519_PRIVATE_PB_PREFIX) :]
        identity = cls(body[:32])
        if identity.public_key != body[32:]:
            raise ProtocolError("the identity file's public key does not match its private key")
        return identity

    def to_file_bytes(self) -> bytes:
        """The libp2p ``PrivateKey`` protobuf that p2pd accepts as ``-id`` (seed followed by public key)."""
        seed = self._key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                       serialization.NoEncryption())
        return _ED25519_PRIVATE_PB_PREFIX + seed + self.public_key

    def sign(self, message: bytes) -> bytes:
        return self._key.sign(message)


def verify_signature(peer_id: str, message: bytes, signature: bytes) -> bool:
    """True if ``signature`` over ``message`` was made by the key embedded in ``peer_id``."""
    try:
        key = Ed25519PublicKey.from_public_bytes(public_key_from_peer_id(peer_id))
        key.verify(signature, message)
        return True
    except (ProtocolError, InvalidSignature, ValueError):
        return False


# ---------------------------------------------------------------------------------------------------------------
# Signed envelope
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Envelope:
    """A verified envelope: who signed it, its decoded body, and a digest that names these exact bytes."""

    kind: str
    signer: str  # base58 peer id
    body: dict[str, Any]
    digest: str  # sha256 of the whole envelope


def _signed_message(kind: str, signer: bytes, body: bytes) -> bytes:
    # The kind and signer are inside the signed bytes, so a manifest signature can't pass as an announcement and
    # a record can't be re-attributed to another peer.
    return msgpack.packb(["hlbp-record", kind, signer, body], use_bin_type=True)


def seal(kind: str, body: dict[str, Any], identity: Identity) -> bytes:
    """Sign ``body`` as a record of ``kind`` by ``identity``; returns the envelope bytes stored in the DHT."""
    body_bytes = msgpack.packb(body, use_bin_type=True)
    signer = b58decode(identity.peer_id)
    signature = identity.sign(_signed_message(kind, signer, body_bytes))
    return msgpack.packb([ENVELOPE_MAGIC, ENVELOPE_SCHEMA, kind, signer, body_bytes, signature], use_bin_type=True)


def _unpack(data: bytes, max_bytes: int) -> Any:
    """Canonical, bounded msgpack (see :func:`hlbp.protocol.untrusted.unpack_msgpack`)."""
    return unpack_msgpack(data, max_bytes=max_bytes, what="record")


def open_envelope(data: Any, kind: str, *, max_bytes: int, signer: str | None = None) -> Envelope:
    """Verify an envelope of ``kind``; if ``signer`` is given, the envelope must be signed by that peer id."""
    if not isinstance(data, bytes):
        raise ProtocolError(f"a record must be bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise ProtocolError(f"a {kind} record has {len(data)} bytes, more than the limit of {max_bytes}")
    items = _unpack(data, max_bytes)
    if not isinstance(items, list) or len(items) != 6:
        raise ProtocolError("a record envelope is a 6-item array")
    magic, schema, got_kind, signer_bytes, body_bytes, signature = items
    if magic != ENVELOPE_MAGIC or schema != ENVELOPE_SCHEMA:
        raise ProtocolError("not an hlbp record envelope (wrong magic or envelope schema)")
    if got_kind != kind:
        raise ProtocolError(f"expected a {kind} record, got {preview(got_kind, 32)}")
    if not all(isinstance(x, bytes) for x in (signer_bytes, body_bytes, signature)):
        raise ProtocolError("envelope signer, body and signature must be bytes")
    if len(signer_bytes) > 64 or len(signature) != 64:
        raise ProtocolError("envelope signer or signature has the wrong size")
    signer_id = b58encode(signer_bytes)
    if signer is not None and signer_id != signer:
        raise ProtocolError(f"record signed by {signer_id[:60]} is stored under peer {preview(signer, 60)}")
    if not verify_signature(signer_id, _signed_message(kind, signer_bytes, body_bytes), signature):
        raise ProtocolError(f"bad signature on a {kind} record claiming to be from {signer_id[:60]}")
    body = _unpack(body_bytes, max_bytes)
    if not isinstance(body, dict):
        raise ProtocolError("a record body is a map")
    return Envelope(kind=kind, signer=signer_id, body=body, digest=sha256_hex(data))
