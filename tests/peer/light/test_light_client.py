"""The daemon-free light client against real processes on loopback: a bootstrap, two replicas and a stage peer
(each with its own p2pd), read over py-libp2p by ``hlbp status --light`` and ``hlbp fetch --light`` in processes
that never load hivemind; a lying node that serves a snapshot with a record changed in transit; and an address
where nobody listens."""

from __future__ import annotations

import hashlib
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from hlbp.peer.sim.launcher import PeerProcess, SimConfig, Swarm, poll

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
# `hlbp` itself, in a process that reports at exit which of these top-level packages it ever imported
TRACKED = ("hivemind", "libp2p", "torch", "trio")
_REPORT_MODULES = ("import atexit, sys\n"
                   "atexit.register(lambda: print('LOADED', *sorted({m.split('.')[0] for m in sys.modules} & "
                   f"{set(TRACKED)!r}), file=sys.stderr))\n"
                   "from hlbp.cli.main import main\nmain()")
HLBP_TRACKED = (sys.executable, "-c", _REPORT_MODULES)
HLBP_P2PD = (sys.executable, "-m", "hlbp.cli.control_cmds")


@dataclass
class Run:
    swarm: Swarm
    maddr: str  # the bootstrap's
    boot_id: str
    replica_ids: list[str]
    stage_id: str  # a stage peer holding stage 0 of swarm 0
    tokenizer: bytes
    env: dict[str, str]


def hlbp(run: Run, *args: str, program: tuple[str, ...] = HLBP_TRACKED,
         timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*program, *args], capture_output=True, text=True, timeout=timeout, env=run.env,
                          check=False)


def loaded(proc: subprocess.CompletedProcess[str]) -> set[str]:
    lines = [line for line in proc.stderr.splitlines() if line.startswith("LOADED")]
    assert lines, proc.stderr
    return set(lines[-1].split()[1:])


def light_json(run: Run, maddr: str, *extra: str) -> tuple[dict, set[str]]:
    proc = hlbp(run, "status", "--light", "--json", "--initial-peers", maddr, *extra)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), loaded(proc)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    """``hlbp bootstrap``, two ``hlbp join --no-train`` replicas and a stage peer, each with its own p2pd on
    127.0.0.1."""
    tmp = tmp_path_factory.mktemp("light")
    tok = tmp / "tokenizer.json"
    tok.write_text('{"model": "stand-in tokenizer for the light client", "pad": "' + "x" * 300_000 + '"}')
    cfg = SimConfig(run_id="light-run", ttl_s=60.0, cache_dir=tmp / "cache", stop_timeout_s=10.0)
    with Swarm(cfg, tmp / "swarm", env={"HLBP_TOKENIZER": str(tok)}) as swarm:
        maddr = swarm.start()
        joiners = [swarm.add(f"r{i}", "--no-train", "--memory-gb", "8") for i in range(2)]
        joiners.append(swarm.add_stage("s0", 0, "--no-train", "--memory-gb", "8"))
        ids = [r.proc.wait_for(r"^connected as (\S+)", 90).group(1) for r in joiners]
        for r in joiners:
            r.proc.wait_for("^announced in", 90)
        run = Run(swarm, maddr, maddr.split("/p2p/")[1], ids[:2], ids[2], tok.read_bytes(), swarm.env)
        everyone = {run.boot_id, *ids}
        poll(lambda: {p["peer_id"] for p in light_json(run, maddr)[0]["peers"]} == everyone, 30,
             "the bootstrap's snapshot to hold every peer")
        yield run


def test_light_status_shows_the_peers_that_status_shows_and_never_loads_hivemind_or_torch(run: Run):
    everyone = {run.boot_id, *run.replica_ids, run.stage_id}
    light, modules = light_json(run, run.maddr)
    assert "hivemind" not in modules and "torch" not in modules and {"libp2p", "trio"} <= modules
    assert light["light"] and light["rejected"] == [] and light["signer"] == run.boot_id

    full = subprocess.run([*HLBP_P2PD, "status", "--json", "--initial-peers", run.maddr], capture_output=True,
                          text=True, timeout=60, env=run.env, check=True)
    report = json.loads(full.stdout)

    def rows(r: dict) -> list[tuple]:
        return sorted((p["peer_id"], p["role"], p["swarm"], p["stage"], p["online"], p["manifest_current"],
                       p["software"]) for p in r["peers"])

    assert rows(light) == rows(report) and {p["peer_id"] for p in light["peers"]} == everyone
    for key in ("run_id", "model", "stages", "signer", "manifest_digest", "protocol", "outer", "round"):
        assert light[key] == report[key], key

    assert [p["role"] for p in light["peers"]] == ["bootstrap", "replica", "replica", "stage"]

    # every node serves the snapshot: through a replica and through a stage peer, trusting the bootstrap's
    # manifest via the dialled peer's own record
    for peer_id in (run.replica_ids[1], run.stage_id):
        via = next(p for p in light["peers"] if p["peer_id"] == peer_id)["maddrs"][0]
        through, modules = light_json(run, via)
        assert rows(through) == rows(light) and through["signer"] == run.boot_id and through["source"] == via
        assert "hivemind" not in modules


def test_light_fetch_downloads_the_tokenizer_checks_its_hash_and_never_loads_torch(run: Run, tmp_path: Path):
    sha = hashlib.sha256(run.tokenizer).hexdigest()
    out = tmp_path / "tok.json"
    proc = hlbp(run, "fetch", sha[:12], "--light", "--initial-peers", run.maddr, "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["sha256"] == sha and result["size"] == len(run.tokenizer) and out.read_bytes() == run.tokenizer
    assert not {"hivemind", "torch"} & loaded(proc) and not list(tmp_path.glob("*.partial"))

    missing = hlbp(run, "fetch", "0123456789ab", "--light", "--initial-peers", run.maddr, "--out", str(out))
    assert missing.returncode == 2 and "lists no artifact with hash 0123456789ab" in missing.stderr


def test_a_record_tampered_in_transit_is_rejected_never_shown(run: Run):
    victim = run.replica_ids[0]
    liar = PeerProcess("tamper", [str(HERE / "tamper_node.py"), run.maddr, victim], run.env,
                       program=(sys.executable,))
    try:
        liar_maddr = liar.wait_for(r"^listening (\S+)", 60).group(1)
        report, modules = light_json(run, liar_maddr, "--manifest-signer", run.boot_id)
        assert "hivemind" not in modules
        assert [(r["kind"], r["author"]) for r in report["rejected"]] == [("announcement", victim)]
        assert "bad signature" in report["rejected"][0]["reason"]
        assert {p["peer_id"] for p in report["peers"]} == {run.boot_id, run.replica_ids[1], run.stage_id}

        table = hlbp(run, "status", "--light", "--initial-peers", liar_maddr, "--manifest-signer", run.boot_id)
        assert table.returncode == 0, table.stderr
        assert f"rejected announcement of {victim[-8:]}: bad signature" in table.stdout
        assert victim[-8:] not in table.stdout.split("rejected")[0]  # not a row of the table
        # trusting the liar itself as the manifest signer finds no manifest it signed: nothing is shown
        alone = hlbp(run, "status", "--light", "--initial-peers", liar_maddr)
        assert alone.returncode == 2 and "holds no manifest signed by" in alone.stderr
    finally:
        liar.kill()


@pytest.mark.parametrize("cuts", [1, 2])
def test_a_stream_cut_mid_answer_is_asked_again_once(run: Run, cuts: int):
    # a node that resets the stream after the response header: once is a loaded node or a dropped connection and
    # costs one more dial; every time is reported, in one line
    flaky = PeerProcess("flaky", [str(HERE / "tamper_node.py"), run.maddr, "-", "--cut-first", str(cuts)], run.env,
                        program=(sys.executable,))
    try:
        flaky_maddr = flaky.wait_for(r"^listening (\S+)", 60).group(1)
        proc = hlbp(run, "status", "--light", "--json", "--initial-peers", flaky_maddr, "--manifest-signer",
                    run.boot_id)
        if cuts == 1:
            assert proc.returncode == 0, proc.stderr
            assert {p["peer_id"] for p in json.loads(proc.stdout)["peers"]} == {run.boot_id, *run.replica_ids,
                                                                              run.stage_id}
        else:
            lines = [line for line in proc.stderr.splitlines() if not line.startswith("LOADED")]
            assert proc.returncode == 2 and len(lines) == 1, proc.stderr
            assert "closed the stream after 0 of" in lines[0] and "on each of 2 tries" in lines[0], lines
    finally:
        flaky.kill()


def test_an_unreachable_address_is_one_line_and_exit_status_2(run: Run):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    addr = f"/ip4/127.0.0.1/tcp/{port}/p2p/{run.boot_id}"
    started = time.monotonic()
    proc = hlbp(run, "status", "--light", "--initial-peers", addr, "--connect-timeout", "5")
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("LOADED")]
    assert len(lines) == 1 and lines[0].startswith("error: could not dial") and addr in lines[0], proc.stderr
    assert "Connection refused" in lines[0] and "hivemind" not in loaded(proc)
    assert time.monotonic() - started < 30
