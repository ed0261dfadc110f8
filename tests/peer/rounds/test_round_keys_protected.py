"""A DHT node that protects a round's keys refuses records not signed by the peer they are stored under."""

import hivemind
import pytest
from hivemind.utils import get_dht_time

from hlbp.peer.net.validation import record_validator
from hlbp.protocol.identity import Identity
from hlbp.protocol.roundwire import KIND_CONTRIB, MAX_RECORD_BYTES, ContribNotice, round_key, sign


@pytest.mark.slow
def test_forged_round_record_is_refused_and_a_real_one_kept():
    key = round_key("run", 3, KIND_CONTRIB)
    honest, forger = Identity.generate(), Identity.generate()
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        dht.add_validators([record_validator(extra={key: (KIND_CONTRIB, MAX_RECORD_BYTES)})])
        body = ContribNotice(honest.peer_id, 3, 10, {0: "ab" * 32}, {0: 100}).to_body("run")
        expires = get_dht_time() + 60
        assert dht.store(key, sign(KIND_CONTRIB, body, honest), expires, subkey=honest.peer_id)
        # the forger signs with its own key but stores under the honest peer's id, with a later expiration
        assert not dht.store(key, sign(KIND_CONTRIB, body, forger), expires + 30, subkey=honest.peer_id)
        assert not dht.store(key, b"not an envelope", expires + 30, subkey=forger.peer_id)
        found = dht.get(key, latest=True).value
        assert list(found) == [honest.peer_id]
        assert found[honest.peer_id].value == sign(KIND_CONTRIB, body, honest)
    finally:
        dht.shutdown()
