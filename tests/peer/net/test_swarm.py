"""The control plane across real processes on loopback: bootstrap, joiners, status, forgeries, failures."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from control_helpers import LOOPBACK, Proc, free_tcp_port, joiner_peer_id, poll, start_bootstrap, start_joiner

from hlbp.peer.node.join import thresholds_for
from hlbp.peer.node.roles import Capacity, PeerView, choose_role
from hlbp.protocol.announcement import KIND_ANNOUNCEMENT, Announcement, encode_announcement, peers_key
from hlbp.protocol.identity import Identity, seal
from hlbp.protocol.manifest import KIND_MANIFEST, PROTOCOL_VERSION

pytestmark = pytest.mark.slow

# (memory GB, full-model tok/s) of the joiners, in joining order; the run wants 1000 tok/s for a replica
JOINERS = [(8.0, 5000.0), (8.0, 100.0), (8.0, 300.0), (8.0, 200.0)]


@dataclass
class Swarm:
    bootstrap: Proc
    maddr: str
    boot_id: str
    observer: object
    joiners: list[Proc]
    ids: list[str]
    predicted: list[tuple[str, int | None, int | None]]
    run_id: str


def _online(observer, run_id: str) -> dict:
    return {p: r for p, r in observer.read_peers(run_id).items() if r.announcement.online}


@pytest.fixture(scope="module")
def swarm(spawn, observer_factory, tmp_path_factory) -> Swarm:
    """A bootstrap and four joiners that join one after another, each after the policy's prediction is taken.

    The first joiner (a full replica) announces an address nobody listens on and asks for a reachability check, so
    it must fall back to DHT client mode (a stage peer would be refused instead: tests/peer/net/test_nat.py).
    """
    tmp = tmp_path_factory.mktemp("swarm")
    boot, maddr, boot_id = start_bootstrap(spawn, tmp, ttl=10)
    observer = observer_factory(maddr)
    signed = observer.find_manifest({boot_id}, False, 20)
    run_id = signed.manifest.run_id
    thresholds = thresholds_for(signed.manifest)
    joiners, ids, predicted = [], [], []
    for i, (memory, tps) in enumerate(JOINERS):
        seen = poll(lambda n=i: len(_online(observer, run_id)) == n + 1 and _online(observer, run_id), 30,
                    f"{i} joiners and the bootstrap online")
        views = [PeerView(p, r.announcement.role, r.announcement.swarm, r.announcement.stage,
                          r.announcement.throughput) for p, r in seen.items()]
        role = choose_role(Capacity(memory, tps, 1e8), views, len(signed.manifest.stages), thresholds)
        predicted.append((role.kind, role.swarm, role.stage))
        extra: tuple[str, ...] = ()
        if i == 0:
            extra = ("--reachability", "auto", "--announce-maddrs", f"/ip4/127.0.0.1/tcp/{free_tcp_port()}")
        proc = start_joiner(spawn, maddr, tmp, *extra, memory_gb=memory, throughput=tps,
                            bandwidth=None if i == 0 else "1e8")
        joiners.append(proc)
        ids.append(joiner_peer_id(proc))
    poll(lambda: len(_online(observer, run_id)) == len(JOINERS) + 1, 30, "every joiner online")
    return Swarm(boot, maddr, boot_id, observer, joiners, ids, predicted, run_id)


def test_joiners_get_the_roles_the_policy_predicts(swarm: Swarm):
    records = _online(swarm.observer, swarm.run_id)
    actual = [(records[p].announcement.role, records[p].announcement.swarm, records[p].announcement.stage)
              for p in swarm.ids]
    assert actual == swarm.predicted
    # With these capacities the policy reads: strong -> replica; then complete swarm 0; then open swarm 1.
    assert actual == [("replica", None, None), ("stage", 0, 0), ("stage", 0, 1), ("stage", 1, 0)]
    assert records[swarm.boot_id].announcement.role == "bootstrap"
    first = records[swarm.ids[0]].announcement
    assert first.bandwidth > 0  # measured by a real probe over the data plane, not forced


def test_an_undialable_joiner_falls_back_to_client_mode_and_says_how_to_fix_it(swarm: Swarm):
    first = swarm.joiners[0]
    assert "reachability: behind NAT" in first.output and "--announce-maddrs" in first.output
    records = _online(swarm.observer, swarm.run_id)
    assert records[swarm.ids[0]].announcement.reachability == "client"
    assert records[swarm.ids[-1]].announcement.reachability == "public"


def test_status_lists_every_peer(swarm: Swarm):
    cmd = [sys.executable, "-m", "hlbp.cli.control_cmds", "status", "--initial-peers", swarm.maddr]
    out = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=60, check=True).stdout
    report = json.loads(out)
    assert report["run_id"] == swarm.run_id and report["signer"] == swarm.boot_id
    by_id = {p["peer_id"]: p for p in report["peers"]}
    assert set(by_id) == {swarm.boot_id, *swarm.ids}
    assert [(by_id[p]["role"], by_id[p]["swarm"], by_id[p]["stage"]) for p in swarm.ids] == swarm.predicted
    assert all(p["manifest_current"] and p["software"] and p["record_bytes"] < 1024 for p in report["peers"])
    table = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout
    assert swarm.run_id in table and "replica" in table and "bootstrap" in table


def test_forged_and_malformed_records_are_ignored(swarm: Swarm):
    import hivemind
    from hivemind.utils import get_dht_time

    # A plain hivemind node, without hlbp's validator, writes whatever it likes.
    forger_dht = hivemind.DHT(initial_peers=[swarm.maddr], start=True, host_maddrs=[LOOPBACK], nat_port_map=False)
    try:
        attacker = Identity.generate()
        victim = swarm.ids[0]
        now = get_dht_time()
        fake = Announcement(run_id=swarm.run_id, role="stage", swarm=0, stage=0, throughput=1e9,
                            issued_at=now, expires_at=now + 30)
        bodies = {
            # the victim's slot, signed by someone else, meant to outlive the victim's own record
            victim: encode_announcement(fake, attacker),
            # garbage, an unsigned envelope, an oversized one, and an expired one under the attacker's own id
            "12D3KooWgarbage": b"\xc1\xc1 not msgpack",
            attacker.peer_id: seal(KIND_ANNOUNCEMENT, fake.to_body(), attacker)[:-64] + b"\0" * 64,
            # (5 KB: over the 4 KiB record limit, under the 64 KiB that hivemind's command pipe can carry)
            Identity.generate().peer_id: b"x" * 5000,
        }
        old = Identity.generate()
        bodies[old.peer_id] = encode_announcement(
            Announcement(run_id=swarm.run_id, role="replica", issued_at=now - 100, expires_at=now - 50), old)
        for subkey, value in bodies.items():
            forger_dht.store(peers_key(swarm.run_id), value, now + 600, subkey=subkey)
        # and a manifest "signed" by the bootstrap that is not
        forger_dht.store("hlbp:manifest", seal(KIND_MANIFEST, {"run": "evil"}, attacker), now + 600,
                         subkey=swarm.boot_id)

        records = poll(lambda: _online(swarm.observer, swarm.run_id), 10, "peer records")
        assert set(records) == {swarm.boot_id, *swarm.ids}
        assert records[victim].announcement.role == "replica"  # the victim's own record survived
        assert swarm.observer.find_manifest({swarm.boot_id}, True, 10).manifest.run_id == swarm.run_id
        # honest nodes logged each refusal once, not per read
        refusals = [line for line in swarm.bootstrap.output.splitlines() if "DHT refused" in line]
        assert 0 < len(refusals) <= len(bodies) + 1
    finally:
        forger_dht.shutdown()


def test_a_plain_hivemind_dht_can_use_the_bootstrap(swarm: Swarm):
    import hivemind
    from hivemind.utils import get_dht_time

    a = hivemind.DHT(initial_peers=[swarm.maddr], start=True, host_maddrs=[LOOPBACK], nat_port_map=False)
    b = hivemind.DHT(initial_peers=[swarm.maddr], start=True, host_maddrs=[LOOPBACK], nat_port_map=False)
    try:
        assert a.store("plain-key", {"hello": [1, 2]}, get_dht_time() + 30)
        found = poll(lambda: b.get("plain-key", latest=True), 10, "the plain value")
        assert found.value == {"hello": [1, 2]}
    finally:
        a.shutdown()
        b.shutdown()


def test_a_newer_protocol_manifest_is_refused_with_a_message(swarm: Swarm, spawn, tmp_path):
    future = Identity.generate()
    manifest = swarm.observer.find_manifest({swarm.boot_id}, True, 10).manifest
    envelope = seal(KIND_MANIFEST, {**manifest.to_body(), "proto": 99}, future)
    assert swarm.observer.publish_manifest(envelope, future.peer_id, ttl=60)
    proc = spawn("join", "--initial-peers", swarm.maddr, "--host-maddrs", LOOPBACK, "--no-train",
                 "--manifest-signer", future.peer_id, "--manifest-timeout", "10", "--memory-gb", "8",
                 "--throughput", "1", "--bandwidth", "1", "--cache-dir", str(tmp_path))
    assert proc.popen.wait(timeout=60) == 2
    assert "protocol version 99" in proc.output and f"speaks version {PROTOCOL_VERSION}" in proc.output


def test_killed_peer_disappears_when_its_record_expires_and_a_leaving_one_at_once(spawn, observer_factory,
                                                                                  tmp_path):
    ttl = 3.0
    _, maddr, boot_id = start_bootstrap(spawn, tmp_path, ttl=ttl)
    observer = observer_factory(maddr)
    run_id = observer.find_manifest({boot_id}, False, 20).manifest.run_id
    victim = start_joiner(spawn, maddr, tmp_path, ttl=ttl)
    # the leaver's records live 30 s: its offline record must still be there to be read, however long the box took
    # to stop it, and it must be that record, not an expiry, that takes it off the list within 5 s
    leaver = start_joiner(spawn, maddr, tmp_path, ttl=30.0)
    victim_id, leaver_id = joiner_peer_id(victim), joiner_peer_id(leaver)
    poll(lambda: {victim_id, leaver_id} <= set(_online(observer, run_id)), 20, "both joiners online")

    start = time.monotonic()
    victim.kill_all()
    poll(lambda: victim_id not in observer.read_peers(run_id), ttl + 10, "the killed peer's record to expire")
    gone_after = time.monotonic() - start
    assert gone_after <= ttl + 10

    start = time.monotonic()
    assert leaver.terminate(timeout=20) == 0
    left_after = time.monotonic() - start
    assert left_after < 15, f"SIGTERM took {left_after:.1f} s"
    assert "marking this peer offline" in leaver.output
    def offline() -> bool:
        rec = observer.read_peers(run_id).get(leaver_id)
        return rec is not None and not rec.announcement.online

    poll(offline, 5, "the leaver's offline record")
    assert leaver_id not in _online(observer, run_id)


def test_the_swarm_survives_its_bootstrap(spawn, observer_factory, tmp_path):
    ttl = 3.0
    boot, maddr, boot_id = start_bootstrap(spawn, tmp_path, ttl=ttl)
    a = start_joiner(spawn, maddr, tmp_path, ttl=ttl)
    b = start_joiner(spawn, maddr, tmp_path, ttl=ttl)
    a_id, b_id = joiner_peer_id(a), joiner_peer_id(b)
    first = observer_factory(maddr)
    run_id = first.find_manifest({boot_id}, False, 20).manifest.run_id
    a_maddr = poll(lambda: first.read_peers(run_id).get(a_id), 20, "joiner a's record").announcement.maddrs[0]

    boot.kill_all()
    killed_at = time.time()
    observer = observer_factory(a_maddr)  # enters through a joiner: the bootstrap is gone

    def both_refreshed() -> bool:
        records = observer.read_peers(run_id)
        return all(p in records and records[p].announcement.issued_at > killed_at + ttl for p in (a_id, b_id))

    poll(both_refreshed, 30, "both joiners re-announcing after the bootstrap died")
    assert boot_id not in _online(observer, run_id) or time.time() - killed_at < ttl
    # The manifest outlived its signer (the joiners re-publish it), and a newcomer who only knows joiner a
    # trusts it through a's announcement.
    late = start_joiner(spawn, a_maddr, tmp_path, ttl=ttl)
    assert f"signed by {boot_id}" in late.output
    poll(lambda: joiner_peer_id(late) in _online(observer, run_id), 20, "the late joiner online")


def test_join_without_a_reachable_peer_lists_every_address_tried(tmp_path: Path):
    ids = [Identity.generate().peer_id for _ in range(2)]
    addrs = [f"/ip4/127.0.0.1/tcp/{free_tcp_port()}/p2p/{i}" for i in ids]
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "hlbp.cli.control_cmds", "join", "--initial-peers", ",".join(addrs),
         "--host-maddrs", LOOPBACK, "--connect-timeout", "2", "--no-train"],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert proc.returncode == 2, proc.stderr
    message = " ".join(proc.stderr.split())  # rich wraps long lines
    assert all(a in proc.stderr.replace("\n", "") or a in message for a in addrs)
    assert "Check that" in message and "--connect-timeout" in message
    assert time.monotonic() - started < 40


class _FlakyHelper:
    """The observer's real control plane, whose first ``failures`` dial-back requests fail as a busy helper's do."""

    def __init__(self, plane, failures: int) -> None:
        self.plane, self.failures, self.asked = plane, failures, 0

    def maddrs(self) -> list[str]:
        return self.plane.maddrs()

    def dial_back(self, peer_id: str, maddrs: list[str]) -> tuple[list[str], list[str]]:
        self.asked += 1
        if self.asked <= self.failures:
            raise TimeoutError("the helper did not answer in time")
        return self.plane.dial_back(peer_id, maddrs)


def test_a_dial_back_check_asks_again_until_a_helper_answers(swarm: Swarm):
    from hlbp.peer.net.reach import Reachability
    from hlbp.peer.node.join import check_reachability

    truth, _ = check_reachability(swarm.observer, [swarm.boot_id])
    assert truth is not Reachability.UNKNOWN
    # the bootstrap fails twice (busy): the check goes on past a stranger's id and answers as an idle helper does
    flaky = _FlakyHelper(swarm.observer, failures=2)
    stranger = Identity.generate().peer_id
    assert check_reachability(flaky, [stranger, swarm.boot_id], deadline_s=30)[0] is truth
    assert flaky.asked == 4  # stranger and bootstrap (both failed), then stranger (unknown) and bootstrap (answered)
    # a helper that never answers: unknown once the deadline has passed, not before
    start = time.monotonic()
    silent = _FlakyHelper(swarm.observer, failures=10**6)
    assert check_reachability(silent, [swarm.boot_id], deadline_s=5)[0] is Reachability.UNKNOWN
    assert 3.0 <= time.monotonic() - start < 30 and silent.asked >= 2


def test_the_data_plane_serves_the_tokenizer_and_a_probe_whole(swarm: Swarm, tmp_path):
    """Both bodies are read a chunk at a time at the pace floor and written the same way (transport.read_body,
    write_body): what arrives is the announced bytes, exactly."""
    signed = swarm.observer.find_manifest({swarm.boot_id}, False, 20)
    artifacts = signed.manifest.artifacts
    assert artifacts
    for artifact in artifacts:
        path = swarm.observer.fetch_artifact(artifact, [swarm.boot_id], tmp_path / artifact.name)
        assert path.stat().st_size == artifact.size
    response, body, seconds = swarm.observer.request(swarm.boot_id, {"op": "probe", "bytes": 3 << 20}, 3 << 20)
    assert response["size"] == 3 << 20 and body == bytes(3 << 20) and seconds > 0
