"""Peers behind NAT, in network namespaces this test creates (tests/peer/net/netns.py): a public bootstrap, two
public full replicas, and two full replicas each behind a masquerading home router with no inbound path.

What must hold: the NATed replicas find out at join that nobody can dial them and say so in one line; every round
closes with all four checksums equal and the NATed replicas' contributions accepted (they serve their payloads over
the connections they open to the public peers, and coordinate only after them); ``hlbp status`` shows each peer's
reachability; and a stage peer behind NAT is refused the stage role with one line and exit status 2.

Needs root, iproute2 and iptables (``make setup`` installs iptables); without them it is skipped, saying which is
missing. Where the kernel cannot masquerade, the lab falls back to routed addresses whose router drops every
connection opened from outside, and the test says so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
from netns import LabMode, NatLab, masquerade_supported, netns_unavailable

from hlbp.peer.sim.launcher import SimConfig, Swarm, poll

pytestmark = pytest.mark.slow

ROUNDS = 4  # rounds checked (the replicas go on until the module ends, so that status still finds them online)
ROUND_TIMEOUT_S = 150.0  # a bound on starting six fresh interpreters and four rounds on 2 busy cores
PUBLIC, BEHIND_NAT = ("a", "b"), ("n0", "n1")
UNAVAILABLE = netns_unavailable()
HLBP = (sys.executable, "-m", "hlbp.cli.control_cmds")
# HLBP_TEST_NAT_MODE=drop-inbound runs the swarm on the fallback lab even where the kernel can masquerade
FORCED_MODE = LabMode(os.environ["HLBP_TEST_NAT_MODE"]) if os.environ.get("HLBP_TEST_NAT_MODE") else None
# a TCP server that prints whom it accepted, and a client that connects to it (plain sockets: no hlbp involved)
SERVER = ("import socket; s = socket.create_server(('0.0.0.0', 5555)); print('listening', flush=True); "
          "c, a = s.accept(); print(a[0], flush=True)")
CLIENT = "import socket, sys; socket.create_connection((sys.argv[1], 5555), timeout=2); print('connected')"


@pytest.fixture(scope="module")
def lab() -> Iterator[NatLab]:
    if UNAVAILABLE is not None:
        pytest.skip(f"the NAT test builds network namespaces, and cannot here: {UNAVAILABLE}")
    with NatLab(n_private=2, mode=FORCED_MODE) as built:
        if built.fallback_reason is not None:
            warnings.warn(f"the kernel cannot masquerade ({built.fallback_reason}); the peers behind 'NAT' have "
                          "routed addresses whose router drops every inbound connection instead", stacklevel=1)
        yield built


@pytest.fixture(scope="module")
def swarm(lab: NatLab, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Swarm]:
    """Bootstrap, a and b on the public segment; n0 and n1 behind their routers; every joiner checks whether it can
    be dialled (--reachability auto). A stage peer behind NAT tries to join meanwhile (it must be refused).

    The window is long (20 s): a round closes as soon as all four contributions are in, so it costs nothing while
    every replica keeps up, and a replica that a loaded box slows by a few seconds is not left out as a straggler
    (that is right in a real run, and would make this test, which asserts the NATed contributions are taken, pass
    by luck)."""
    cfg = SimConfig(n_full=0, rounds=1000, inner_steps=6, batch_size=4, seq_len=64, round_deadline_s=20.0,
                    min_deadline_s=20.0, max_deadline_s=30.0, seed=7, threads=1, run_id="nat-test", ttl_s=10.0,
                    fork=False)  # each process starts inside its namespace: `ip netns exec` execs a fresh one
    with Swarm(cfg, tmp_path_factory.mktemp("nat")) as sw:
        sw.start(program=lab.public.program(*HLBP), listen=lab.public.listen())
        hosts = {"a": lab.public, "b": lab.public, "n0": lab.private[0], "n1": lab.private[1]}
        for name, host in hosts.items():
            sw.add(name, "--reachability", "auto", "--wait-replicas", "4", program=host.program(*HLBP),
                   listen=host.listen())
        sw.add_stage("stage-nat", 1, "--reachability", "auto", "--memory-gb", "8",
                     program=lab.private[0].program(*HLBP), listen=lab.private[0].listen())
        yield sw


def _status(lab: NatLab, swarm: Swarm) -> dict[str, Any]:
    out = subprocess.run(lab.public.program(*HLBP, "status", "--initial-peers", swarm.maddr, "--json"),
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return json.loads(out)


def _ids(swarm: Swarm) -> dict[str, str]:
    for name in (*PUBLIC, *BEHIND_NAT):
        swarm.replicas[name].proc.wait_for(r"^connected as", ROUND_TIMEOUT_S)
        swarm.replicas[name].metrics_path()  # reads the peer id from that line
    return {name: swarm.replicas[name].peer_id for name in (*PUBLIC, *BEHIND_NAT)}


def test_the_lab_masquerades_or_says_why_not(lab: NatLab) -> None:
    if FORCED_MODE is None:
        assert (lab.mode is LabMode.MASQUERADE) == (masquerade_supported() is None), lab.fallback_reason


def _connect(server: Any, client: Any) -> tuple[bool, str]:
    """Whether ``client`` can open a TCP connection to ``server`` (once it listens), and the source address the
    server saw."""
    srv = subprocess.Popen(server.program(sys.executable, "-c", SERVER), stdout=subprocess.PIPE, text=True)
    try:
        assert srv.stdout is not None and srv.stdout.readline().strip() == "listening"
        ok = subprocess.run(client.program(sys.executable, "-c", CLIENT, server.address), capture_output=True,
                            text=True, timeout=20, check=False).returncode == 0
        return ok, srv.communicate(timeout=5)[0].strip() if ok else ""
    finally:
        srv.kill()
        srv.wait()
        if srv.stdout is not None:
            srv.stdout.close()


@pytest.mark.parametrize("mode", list(LabMode))
def test_a_host_behind_the_router_dials_out_but_cannot_be_dialled(mode: LabMode) -> None:
    if UNAVAILABLE is not None:
        pytest.skip(f"the NAT test builds network namespaces, and cannot here: {UNAVAILABLE}")
    if mode is LabMode.MASQUERADE and masquerade_supported() is not None:
        pytest.skip(f"the kernel cannot masquerade: {masquerade_supported()}")
    with NatLab(n_private=2, mode=mode) as small:
        ok, seen = _connect(small.public, small.private[0])
        assert ok
        # masqueraded: the public side sees the router's address, not the private one
        assert (seen == "198.18.0.10") if mode is LabMode.MASQUERADE else (seen == small.private[0].address), seen
        assert _connect(small.private[0], small.public) == (False, "")  # no inbound path
        assert _connect(small.private[1], small.private[0]) == (False, "")  # nor from another home


def test_each_joiner_says_in_one_line_how_others_reach_it(swarm: Swarm) -> None:
    for name in PUBLIC:
        swarm.replicas[name].proc.wait_for(r"^reachability: public", ROUND_TIMEOUT_S)
    for name in BEHIND_NAT:
        line = swarm.replicas[name].proc.wait_for(r"^reachability: behind NAT.*", ROUND_TIMEOUT_S).group(0)
        assert "over the connections it opens to public peers" in line and "--announce-maddrs" in line, line


def test_status_shows_each_peers_reachability(lab: NatLab, swarm: Swarm) -> None:
    ids = _ids(swarm)
    report: dict[str, Any] = {}

    def all_announced() -> bool:
        nonlocal report
        try:
            report = _status(lab, swarm)
        except subprocess.TimeoutExpired:  # one slow `hlbp status` on a loaded box: ask again until the deadline
            return False
        return set(ids.values()) <= {p["peer_id"] for p in report["peers"] if p["online"]}

    poll(all_announced, ROUND_TIMEOUT_S, "the four replicas in `hlbp status`", interval=1.0)
    reach = {p["peer_id"]: p["reachability"] for p in report["peers"]}
    assert {name: reach[ids[name]] for name in ids} == {"a": "public", "b": "public", "n0": "client", "n1": "client"}


def test_every_round_agrees_and_takes_the_natted_replicas_contributions(swarm: Swarm) -> None:
    names = (*PUBLIC, *BEHIND_NAT)

    def done() -> bool:
        dead = [n for n in names if not swarm.replicas[n].proc.alive and len(swarm.replicas[n].rounds()) < ROUNDS]
        assert not dead, "\n".join(f"--- {n}\n{swarm.replicas[n].proc.output[-3000:]}" for n in dead)
        return all(len(swarm.replicas[n].rounds()) >= ROUNDS for n in names)

    poll(done, ROUND_TIMEOUT_S, lambda: f"four replicas to finish {ROUNDS} rounds\n"
         + "\n".join(f"--- {n}\n{swarm.replicas[n].proc.output[-2000:]}" for n in names), interval=0.5)
    records = {n: {rec["round"]: rec for rec in swarm.replicas[n].rounds()} for n in names}
    for r in range(ROUNDS):
        recs = {n: records[n][r] for n in names}
        assert len({json.dumps(rec["checksums"], sort_keys=True) for rec in recs.values()}) == 1, (r, recs)
        assert all(rec["in_sync"] for rec in recs.values()), (r, recs)
        # the NATed replicas' contributions are in every round's accepted set. (A public replica's is too, unless a
        # mutual dial between the two public ones fails under load: seen once in six runs, "all dials failed"
        # between a and b while both fetched each other's payload; it is no NAT path, so it is not asserted here.)
        left_out = [n for n in BEHIND_NAT if not (recs[n]["contributed"] and recs[n]["accepted"])]
        assert not left_out, f"round {r}: {left_out} left out\n{recs}\n" + "\n".join(
            f"--- {n}\n{swarm.replicas[n].proc.output[-6000:]}" for n in names)
        assert all(rec["members"] >= len(BEHIND_NAT) + 1 for rec in recs.values()), (r, recs)
    times = [rec["time"] for n in names for r, rec in records[n].items() if r < ROUNDS]
    print(f"rounds 0-{ROUNDS - 1} with two of four replicas behind NAT closed within {max(times) - min(times):.1f} s")


def test_a_stage_peer_behind_nat_is_refused_with_one_line(swarm: Swarm) -> None:
    stage = swarm.replicas["stage-nat"].proc
    poll(lambda: not stage.alive, ROUND_TIMEOUT_S, lambda: "the NATed stage peer to exit\n" + stage.output[-2000:])
    assert stage.popen.returncode == 2, stage.output[-3000:]
    refusals = [line for line in stage.lines if "a stage peer must be dialable" in line]
    assert len(refusals) == 1 and "--announce-maddrs" in refusals[0] and "--role replica" in refusals[0], \
        stage.output[-3000:]
