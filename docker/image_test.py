"""``make image-test``: a run of hlbp containers from the image, as a cloud user starts them.

A bootstrap and two full replicas, each in its own container on a private container network that this test creates
(and removes), configured only by ``HLBP_*`` variables, each peer's ``/data`` a host folder owned by root (the
image's entry point makes it writable for its unprivileged user). It checks that:

1. the image holds every part of hlbp (a stage peer's modules import) and runs as uid 10001;
2. the replicas train rounds with equal checksums;
3. ``stop`` (SIGTERM, then SIGKILL after 10 s, Docker's default grace) ends a replica in under 10 s with exit
   code 0 and its checkpoint written;
4. the stopped container, started again, resumes from that checkpoint and trains further rounds whose checksums
   equal the other replica's.

It needs the image (``make image``) and docker, podman or buildah's podman; it is not part of ``make test``
(building torch into an image takes longer than the suite). Exit code 0 when every check passed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

from hlbp.peer.sim.launcher import SimConfig, poll
from hlbp.peer.sim.report import checksums_agree
from hlbp.peer.train.metricslog import read_metrics

SUBNET = "10.213.77"  # the test's own container network (created and removed here)
GRACE_S = 10  # Docker's default stop grace
# limits the container runtime sets: some sandboxes refuse raising them to the host's own hard limits
ULIMITS = ["--ulimit", "nproc=4096:4096", "--ulimit", "nofile=16384:16384"]


def engine() -> str:
    """docker when its daemon answers, else podman."""
    if os.environ.get("ENGINE"):
        return os.environ["ENGINE"]
    if shutil.which("docker") and subprocess.run(["docker", "info"], capture_output=True, check=False).returncode == 0:
        return "docker"
    if shutil.which("podman"):
        return "podman"
    sys.exit("image-test: needs docker (with its daemon) or podman")


class Containers:
    """The containers and network of one test, removed at the end whatever happened."""

    def __init__(self, tool: str, image: str, tag: str) -> None:
        self.tool, self.image, self.tag = tool, image, tag
        self.network = f"hlbp-imgtest-{tag}"
        self.names: list[str] = []
        self.runtime: list[str] = []
        # a peer downloads its corpus with pip: behind a TLS-inspecting proxy it needs this machine's CA bundle,
        # as a user behind one does (PIP_CERT names it; default: pip's own setting here)
        cert = os.environ.get("PIP_CERT") or subprocess.run(
            [sys.executable, "-m", "pip", "config", "get", "global.cert"], capture_output=True, text=True, check=False).stdout.strip()
        self.ca_mounts = (f"{cert}:/etc/hlbp-ca.pem:ro",) if cert and Path(cert).is_file() else ()
        self.ca_env = {"PIP_CERT": "/etc/hlbp-ca.pem", "SSL_CERT_FILE": "/etc/hlbp-ca.pem"} if self.ca_mounts else {}

    def cli(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([self.tool, *args], capture_output=True, text=True, timeout=timeout, check=False)
        if check and done.returncode != 0:
            raise RuntimeError(f"{self.tool} {' '.join(args[:3])} failed: {done.stderr.strip()[-800:]}")
        return done

    def pick_runtime(self) -> None:
        """podman's default OCI runtime may be refused where runc is not (a sandbox): probe, and say which."""
        for runtime in ([], ["--runtime", "runc"]) if self.tool == "podman" else ([],):
            done = self.cli(*runtime, "run", "--rm", *ULIMITS, "--entrypoint", "true", self.image, check=False)
            if done.returncode == 0:
                self.runtime = runtime
                if runtime:
                    print(f"image-test: {self.tool}'s default runtime refused a container here; using runc")
                return
        raise RuntimeError(f"{self.tool} cannot run a container here: {done.stderr.strip()[-800:]}")

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.cli(*self.runtime, "run", *ULIMITS, *args)

    def start(self, name: str, ip: str, data: Path, env: dict[str, str], *command: str,
              mounts: tuple[str, ...] = ()) -> None:
        """A detached container ``name`` at ``ip`` with ``data`` as its /data, configured by ``env`` only (and
        the CA bundle this machine's pip names, when it names one)."""
        flags = [f"-e{k}={v}" for k, v in {**env, **self.ca_env}.items()]
        for m in [*mounts, *self.ca_mounts]:
            flags += ["-v", m]
        self.run("-d", "--name", name, "--network", self.network, "--ip", ip, "-v", f"{data}:/data",
                 "--stop-timeout", str(GRACE_S), *flags, self.image, *command)
        self.names.append(name)

    def logs(self, name: str) -> str:
        done = self.cli("logs", name, check=False)
        return done.stdout + done.stderr

    def state(self, name: str) -> dict[str, Any]:
        return json.loads(self.cli("inspect", "--format", "{{json .State}}", name).stdout)

    def __enter__(self) -> Self:
        self.cli("network", "create", "--subnet", f"{SUBNET}.0/24", self.network)
        return self

    def __exit__(self, *exc: object) -> None:
        for name in self.names:
            self.cli("rm", "-f", "-t", "0", name, check=False)
        self.cli("network", "rm", "-f", self.network, check=False)


def rounds(data: Path) -> list[dict[str, Any]]:
    """A peer's round records so far, from the metrics file its container writes under /data."""
    found = list(data.glob("run/*/*/metrics.jsonl"))
    return [r for r in read_metrics(found[0]) if r.get("event") == "round"] if found else []


def agree(records: list[dict[str, Any]]) -> bool:
    """Whether every round's records carry equal checksums, shard by shard (and there are records)."""
    by_round: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        by_round.setdefault(r["round"], []).append(r)
    return bool(by_round) and all(checksums_agree(rs) for rs in by_round.values())


def losses(records: list[dict[str, Any]]) -> str:
    vals = [r["val_loss"] for r in sorted(records, key=lambda r: r["round"]) if r.get("val_loss") is not None]
    return f"validation loss {vals[0]:.3f} -> {vals[-1]:.3f}" if vals else "no validation loss"


def checked(what: str, ok: bool, detail: str = "") -> None:
    print(f"image-test: {'ok  ' if ok else 'FAIL'} {what}{': ' + detail if detail else ''}")
    if not ok:
        raise SystemExit(1)


def wait_for(what: str, fn: Callable[[], Any], timeout: float, box: Containers, *names: str) -> Any:
    """Poll ``fn`` until it is truthy; fail at once when one of the containers ``names`` is no longer running."""

    def step() -> Any:
        value = fn()
        gone = [n for n in names if not box.state(n).get("Running")]
        if not value and gone:
            raise TimeoutError(f"{', '.join(gone)} exited")
        return value

    try:
        return poll(step, timeout, what, interval=1.0)
    except TimeoutError as exc:
        for name in names:
            print(f"--- {name}:\n{box.logs(name)[-3000:]}")
        checked(what, False, str(exc)[:300])
        raise


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--image", default=os.environ.get("IMAGE", "hlbp:latest"))
    parser.add_argument("--rounds", type=int, default=3, help="rounds both replicas train before the stop")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for each phase")
    args = parser.parse_args()
    tool = engine()
    tag = f"{os.getpid()}"
    work = Path(tempfile.mkdtemp(prefix="hlbp-imgtest-"))
    cfg = SimConfig(n_stages=1, inner_steps=5, batch_size=4, seq_len=64, run_id="image-test", ttl_s=20.0,
                    round_deadline_s=10.0, max_deadline_s=60.0)
    (work / "config").mkdir()
    (work / "config" / "run.toml").write_text(cfg.run_toml(), encoding="utf-8")
    t0 = time.monotonic()
    try:
        with Containers(tool, args.image, tag) as box:
            box.pick_runtime()
            size = float(box.cli("image", "inspect", "--format", "{{.Size}}", args.image).stdout.strip() or 0)
            print(f"image-test: {args.image} ({size / 1e9:.2f} GB) with {tool}")
            probe = box.run("--rm", "--entrypoint", "python3", args.image, "-c",
                            "import os, hlbp.peer.node.stage, hlbp.peer.swarm.server; print(os.getuid())")
            whoami = box.run("--rm", "--entrypoint", "hlbp-entrypoint", args.image, "--version")
            checked("the image holds the stage peer's modules", probe.returncode == 0)
            checked("hlbp in the image runs", whoami.returncode == 0, whoami.stdout.strip())
            data = {n: work / n for n in ("boot", "a", "b")}
            for d in data.values():
                d.mkdir()  # owned by root, as a host folder or a fresh volume is
            box.start(f"hlbp-boot-{tag}", f"{SUBNET}.10", data["boot"],
                      {"HLBP_RUN_CONFIG": "/config/run.toml", "HLBP_TTL": "20",
                       "HLBP_ANNOUNCE_MADDRS": f"/ip4/{SUBNET}.10/tcp/31337"},
                      "bootstrap", mounts=(f"{work / 'config'}:/config:ro",))
            boot = f"hlbp-boot-{tag}"
            line = wait_for("the bootstrap's address", lambda: re.search(
                r"hlbp join --initial-peers (\S+)", box.logs(boot)), args.timeout, box, boot)
            maddr = line.group(1)
            checked("the bootstrap is up", f"/ip4/{SUBNET}.10/" in maddr, maddr)
            peers = {}
            for i, name in enumerate(("a", "b")):
                peers[name] = f"hlbp-{name}-{tag}"
                box.start(peers[name], f"{SUBNET}.{20 + i}", data[name], {
                    "HLBP_INITIAL_PEERS": maddr, "HLBP_ANNOUNCE_MADDRS": f"/ip4/{SUBNET}.{20 + i}/tcp/31337",
                    "HLBP_ROLE": "replica", "HLBP_THREADS": "1", "HLBP_TTL": "20", "HLBP_REACHABILITY": "public",
                    "HLBP_BANDWIDTH": "1e8", "HLBP_WAIT_REPLICAS": "2", "HLBP_CHECKPOINT_EVERY": "0"}, "join")

            def both_have(n: int) -> bool:
                return all(len(rounds(data[x])) >= n for x in ("a", "b"))

            wait_for(f"{args.rounds} rounds on both replicas", lambda: both_have(args.rounds), args.timeout,
                     box, boot, peers["a"], peers["b"])
            recs = rounds(data["a"]) + rounds(data["b"])
            checked(f"{args.rounds} rounds with equal checksums", agree(recs),
                    f"{len(recs)} round records, {losses(recs)}")
            owner = {p.stat().st_uid for p in data["a"].rglob("*")}
            checked("the peer wrote /data as its own user (uid 10001)", owner == {10001}, str(sorted(owner)))

            before = len(rounds(data["a"]))
            t_stop = time.monotonic()
            box.cli("stop", "-t", str(GRACE_S), peers["a"], timeout=GRACE_S + 30)
            stop_s = time.monotonic() - t_stop
            exit_code = box.state(peers["a"]).get("ExitCode")
            checked(f"stop (SIGTERM) ends a replica within {GRACE_S} s with exit code 0",
                    stop_s < GRACE_S and exit_code == 0, f"{stop_s:.1f} s, exit code {exit_code}")
            ckpt = list(data["a"].glob("run/*/*/checkpoint.safetensors"))
            checked("its checkpoint is written", bool(ckpt) and ckpt[0].stat().st_size > 0,
                    f"{ckpt[0].stat().st_size:,} B" if ckpt else "none")

            box.cli("start", peers["a"])
            wait_for("the restarted replica resumes", lambda: re.search(
                r"resumed from checkpoint|synced round", box.logs(peers["a"])), args.timeout, box, peers["a"])
            wait_for("two more rounds of the restarted replica", lambda: len(rounds(data["a"])) >= before + 2,
                     args.timeout, box, boot, peers["a"], peers["b"])
            recs = rounds(data["a"]) + rounds(data["b"])
            files = list(data["a"].glob("run/*/*/metrics.jsonl"))
            checked("the restarted container is the same peer (its identity in /data)", len(files) == 1,
                    f"{len(files)} peers' metrics in its /data")
            resumed = re.search(r"resumed from checkpoint[^\n]*|synced round[^\n]*", box.logs(peers["a"]))
            checked("after the restart the checksums stay equal", agree(recs),
                    resumed.group(0)[:120] if resumed else "")
            print(f"image-test: passed in {time.monotonic() - t0:.0f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
