"""What ``hlbp join`` says about reachability: one line per case, each naming the fix where there is one."""

from __future__ import annotations

from hlbp.peer.net.reach import Reachability
from hlbp.peer.node.join import reachability_line, stage_refusal

ADDRS = ["/ip4/10.1.0.2/tcp/4001/p2p/12D3KooWexample"]


def test_each_case_is_one_line_and_the_nat_ones_name_the_port_and_flags() -> None:
    lines = {r: reachability_line(r, "replica", ADDRS) for r in Reachability}
    assert all("\n" not in line for line in lines.values())
    assert lines[Reachability.PUBLIC].startswith("reachability: public (a peer of the run dialled us back)")
    nat = lines[Reachability.CLIENT]
    assert nat.startswith("reachability: behind NAT (no peer could dial /ip4/10.1.0.2/tcp/4001")
    assert "serves its contributions over the connections it opens" in nat
    assert "forward TCP port 4001" in nat and "--announce-maddrs" in nat
    assert "not checked" in reachability_line(Reachability.CLIENT, "replica", ADDRS, checked=False)


def test_the_stage_refusal_names_the_fix_and_offers_a_replica_only_where_one_fits() -> None:
    line = stage_refusal(ADDRS, replica_fits=True)
    assert "\n" not in line and line.startswith("a stage peer must be dialable")
    assert "forward TCP port 4001" in line and "--host-maddrs" in line and "--role replica" in line
    assert "--role replica" not in stage_refusal(ADDRS, replica_fits=False)
    assert "--reachability client" in stage_refusal(ADDRS, replica_fits=True, checked=False)
