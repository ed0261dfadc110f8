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
    # without a committee the control plane is all-to-all: every notice and checksum record reaches every live peer
    assert large["records_per_peer_round"] > 3.5 * small["records_per_peer_round"]


def test_no_peer_uploads_more_than_a_few_times_f_payloads_whatever_n():
    """Payloads come down per-payload fetch trees (rounds/spread.py): a peer serves at most FANOUT of each (more
    only for the children of peers that left), so the most one peer uploads stays flat in N. Fetched from the
    members, one member uploaded about N payloads a round (1,057 at N = 1000)."""
    runs = {n: simulate_protocol(ProtocolSimConfig(n=n, rounds=10, gather=8, reserves=4, churn=0.1, committee=32,
                                                   seed=4)) for n in (100, 1000)}
    most = {n: run["max_sent_bytes_one_peer_round"] / 48_000 for n, run in runs.items()}  # in payloads
    assert most[1000] <= 8 * 8, most  # F x 2 FANOUT: far below N
    assert most[1000] <= 2 * most[100], most
    for run in runs.values():
        assert run["sent_bytes_per_peer_round"] <= 1.05 * run["recv_bytes_per_peer_round"]  # about F on average


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
