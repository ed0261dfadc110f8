"""The protocol simulator (peer/sim/protocol.py): the gather rule's bounds at N = 100 to 1000 with churn."""

from __future__ import annotations

from hlbp.peer.sim.protocol import ProtocolSimConfig, simulate_protocol


def test_a_thousand_peers_with_churn_close_and_agree_and_fetch_at_most_f_plus_r():
    res = simulate_protocol(ProtocolSimConfig(n=1000, rounds=8, gather=8, reserves=4, churn=0.1, seed=1))
    assert res["rounds_closed"] == res["rounds_agreed"] == 8 and res["sets_refused_by_someone"] == 0
    assert res["max_payloads_fetched_one_peer_round"] <= 8 + 4
    assert 900 <= res["peers_at_end"] <= 1100


def test_payload_bytes_per_peer_stay_flat_while_records_grow_with_n():
    small, large = (simulate_protocol(ProtocolSimConfig(n=n, rounds=6, gather=8, reserves=4, seed=2))
                    for n in (100, 400))
    assert large["recv_bytes_per_peer_round"] <= 1.05 * small["recv_bytes_per_peer_round"]
    # the control plane is still all-to-all: every notice and checksum record reaches every live peer
    assert large["records_per_peer_round"] > 3.5 * small["records_per_peer_round"]
    # and the members between them upload each payload to every other peer: one member serves about N of them
    assert large["max_sent_bytes_one_peer_round"] > 3.5 * small["max_sent_bytes_one_peer_round"]


def test_the_same_seed_gives_the_same_run():
    cfg = ProtocolSimConfig(n=200, rounds=5, seed=3)
    assert simulate_protocol(cfg) == simulate_protocol(cfg)


def test_with_a_committee_no_peer_receives_more_than_64_records_a_round_at_a_thousand():
    res = simulate_protocol(ProtocolSimConfig(n=1000, rounds=10, gather=8, reserves=4, churn=0.1, committee=32,
                                              seed=4))
    assert res["rounds_closed"] == res["rounds_agreed"] == 10 and res["sets_refused_by_someone"] == 0
    assert res["max_records_one_peer_round"] <= 64
    assert res["max_payloads_fetched_one_peer_round"] <= 8 + 4
    # what a peer receives no longer grows with N: a notice goes to one holder, a peer hears the set once
    small = simulate_protocol(ProtocolSimConfig(n=200, rounds=10, gather=8, reserves=4, committee=32, seed=4))
    assert res["records_per_peer_round"] <= 1.2 * small["records_per_peer_round"]
    assert res["records_per_peer_round"] < 10


def test_a_committee_of_leads_only_still_closes_every_round():
    res = simulate_protocol(ProtocolSimConfig(n=300, rounds=6, gather=2, reserves=1, committee=3, seed=5))
    assert res["rounds_closed"] == res["rounds_agreed"] == 6
