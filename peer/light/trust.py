"""Whom a reader trusts to sign the run manifest, from the flags it was given. Shared by ``hlbp join``,
``hlbp status`` and the light client, so every entry point trusts the same peers."""

from __future__ import annotations

from hlbp.peer.common.errors import UserInputError
from hlbp.protocol import ProtocolError
from hlbp.protocol.identity import public_key_from_peer_id


def trusted_signers(initial_peers: list[str], manifest_signers: list[str]) -> tuple[set[str], bool]:
    """(signers, explicit): --manifest-signer ids if given, else the peer ids inside the initial multiaddrs."""
    if manifest_signers:
        for signer in manifest_signers:
            try:
                public_key_from_peer_id(signer)
            except ProtocolError:
                raise UserInputError(f"--manifest-signer {signer!r} is not a peer id like 12D3KooW...") from None
        return set(manifest_signers), True
    return {a.rstrip("/").split("/p2p/")[-1] for a in initial_peers if "/p2p/" in a}, False
