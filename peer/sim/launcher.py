"""A whole swarm on loopback: one bootstrap and N ``hlbp join`` processes, watched through their metrics files.

``hlbp simulate`` and the round fault tests both use this module. Every process runs in its own session, so a
peer can be killed whole (main process, its DHT process and p2pd) the way a spot instance dies, and
:meth:`Swarm.close` can always reap everything that was started, on success, on error and on Ctrl-C alike.
The summary is a pure function of the peers' ``metrics.jsonl`` records, so it is tested without processes.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from hlbp.peer.common import allocator
from hlbp.peer.common.errors import RunFailed
from hlbp.peer.net.wanlink import WanEmulator, free_port
from hlbp.peer.sim.report import (
    checksums_agree,
    count_params,
    states_agree,
    summarize,
)
from hlbp.peer.sim.zygote import ForkedProcess, Zygote, ZygoteError, shared_zygote
from hlbp.peer.train.metricslog import read_metrics

__all__ = [
    "PeerProcess",
    "Replica",
    "SimConfig",
    "Swarm",
    "checksums_agree",
    "count_params",
    "poll",
    "states_agree",
    "summarize",
]  # the report functions live in hlbp.peer.sim.report

logger = logging.getLogger(__name__)

ROUNDS_WAIT_S = 240.0  # :meth:`Swarm.wait`'s bound on a few rounds of small steps on 2 busy cores, not a duration

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
HLBP_PROGRAM = (sys.executable, "-m", "hlbp.cli.control_cmds")  # what runs `bootstrap` and `join` by default


@dataclass
class SimConfig:
    """A simulated run: the manifest's hyperparameters plus how the local processes are started."""

    n_full: int = 4  # full replicas to start
    rounds: int = 5  # outer rounds every replica runs before it leaves
    model: str = "tiny"  # model preset of the run
    n_stages: int = 2  # shards of the parameters (the manifest's stage partition)
    inner_steps: int = 10  # H: inner steps per round
    batch_size: int = 4  # sequences per inner step
    seq_len: int = 64  # tokens per sequence
    round_deadline_s: float = 5.0  # first collection window; later ones adapt within the bounds below
    min_deadline_s: float = 1.0
    max_deadline_s: float = 30.0
    outer: str = "sparseloco"  # sparseloco, diloco (dense rounds through hivemind's all-reduce) or noloco (pairs)
    noloco_payload: str = "dense"  # noloco: the paper's dense outer weights and progress, or SparseLoCo's "sparse"
    min_contributors: int = 1  # a round with fewer accepted contributions by max_deadline_s closes empty
    gather: int = 0  # F: contributions per shard a round accepts (0: every one)
    reserves: int = 0  # R: further contributions the coordinator checks to replace failed ones
    unselected: str = "drop"  # what a contributor the gather set had no room for does with it: drop or keep
    committee: int = 0  # W: committee seats (0: round records all-to-all)
    wan_delay_ms: float = 0.0  # emulated one-way delay in front of every peer (hlbp.peer.net.wanlink); 0: none
    wan_mbps: float | None = None  # emulated link rate of every peer, each direction; None: unlimited
    seed: int = 0  # the run's seed: initial weights and data order
    threads: int = 1  # torch threads per peer, so N peers share a small machine fairly
    run_id: str = "simulate"
    ttl_s: float = 30.0  # lifetime of control-plane records without a refresh
    cache_dir: Path | None = None  # corpus and tokenizer cache; None: the user cache
    startup_timeout_s: float = 120.0  # bootstrap and each joiner must be up within this
    stop_timeout_s: float = 20.0  # SIGTERM, then SIGKILL after this long
    # fork each process from a warm interpreter that imported torch and hivemind once (peer/sim/zygote.py), saving
    # 3-7 CPU-s per process; False: start each as a fresh interpreter
    fork: bool = True
    aggregation: str = "selectors"  # SparseLoCo aggregation of the run (manifest hparams)
    clip_median: bool = True  # median-norm clipping of the run (manifest hparams)
    weighting: str = "equal"  # contributions weighted equally or by their "tokens" (manifest hparams)
    small_tensors: str = "topk"  # SparseLoCo's rule for 1-D and sub-chunk tensors (manifest hparams)
    overlap: str = ""  # rounds overlapped with the next inner phase: none, naive or eager (manifest hparams; "":
    # the outer's default, Hyperparameters.DEFAULT_OVERLAP)
    allowed_peers: tuple[str, ...] = ()  # closed run: the peer ids that may contribute (empty: anyone)
    codec: str = "dense"  # activation codec of the pipeline swarms' stage boundaries (manifest [codec])
    codec_k: int = 0  # its k for the subspace codecs
    codec_dtype: str = ""  # its wire dtype ("": the codec's default)
    max_peers_per_stage: int = 1  # stage peers per stage of a swarm before a new swarm opens (standbys: 2)
    n_swarms: int = 0  # pipeline swarms of n_stages stage peers each, in the same rounds as the full replicas
    micro_batches: int = 2  # micro-batches per inner step of each swarm's driver
    swarm_wan_delay_ms: float | None = None  # the swarms' stage peers' links (None: as the full replicas')
    swarm_wan_mbps: float | None = None
    schedule_steps: int | None = None  # the inner lr schedule's length on every peer (None: rounds x H, the run)
    checkpoint_every_s: float | None = None  # every peer's --checkpoint-every (None: join's default; 0: every round)
    state_dtype: str | None = None  # every peer's --state-dtype (None: join's default)
    state_on_disk: bool | None = None  # every peer's --state-on-disk (None: join's default)
    recompute: bool = False  # every peer's --recompute

    @property
    def schedule_total(self) -> int:
        """Inner steps of the run's learning-rate schedule (the manifest's ``schedule_steps``)."""
        return self.schedule_steps if self.schedule_steps is not None else self.rounds * self.inner_steps

    def stage_bounds(self) -> list[tuple[int, int]]:
        """The layer ranges of the run's stages: what the bootstrap writes into the manifest for :meth:`run_toml`
        (its default split at this model and sequence length), for readers of a finished run's checkpoints."""
        from hlbp.peer.model.decoder import balanced_partition, preset

        return balanced_partition(preset(self.model), self.n_stages, self.seq_len)

    def run_toml(self) -> str:
        """The run config the bootstrap signs into the manifest."""
        allowed = f"allowed_peers = {list(self.allowed_peers)!r}\n".replace("'", '"') if self.allowed_peers else ""
        return (f'{allowed}run_id = "{self.run_id}"\nmodel = "{self.model}"\nn_stages = {self.n_stages}\nseed = {self.seed}\n'
                f"[hparams]\ninner_steps = {self.inner_steps}\nbatch_size = {self.batch_size}\n"
                f"seq_len = {self.seq_len}\nround_deadline_s = {self.round_deadline_s}\n"
                f"min_deadline_s = {self.min_deadline_s}\nmax_deadline_s = {self.max_deadline_s}\n"
                f'outer = "{self.outer}"\nnoloco_payload = "{self.noloco_payload}"\n'
                f'min_contributors = {self.min_contributors}\n'
                f'gather = {self.gather}\nreserves = {self.reserves}\nunselected = "{self.unselected}"\n'
                f"committee = {self.committee}\n"
                f'aggregation = "{self.aggregation}"\nweighting = "{self.weighting}"\n'
                f'small_tensors = "{self.small_tensors}"\n'
                + (f'overlap = "{self.overlap}"\n' if self.overlap else "")
                + f'clip_median = {str(self.clip_median).lower()}\nschedule_steps = {self.schedule_total}\n'
                f'[codec]\nname = "{self.codec}"\nk = {self.codec_k}\n'
                + (f'dtype = "{self.codec_dtype}"\n' if self.codec_dtype else "")
                + f"[placement]\nmax_peers_per_stage = {self.max_peers_per_stage}\n")


def _start(program: list[str], args: list[str], env: dict[str, str],
           zygote: Zygote | None) -> subprocess.Popen[str] | ForkedProcess:
    """``program`` with ``args`` in a new session, its stdout and stderr combined on ``.stdout``: forked from
    ``zygote`` when it can run that program (``python -m MODULE`` or ``python SCRIPT.py``), else a fresh process."""
    if zygote is not None and len(program) >= 2 and program[0] == sys.executable:
        kind, target = ("module", program[2]) if program[1] == "-m" and len(program) == 3 else ("path", program[1])
        if kind == "module" or (len(program) == 2 and target.endswith(".py")):
            try:
                return zygote.spawn(kind, target, args, env)
            except ZygoteError as exc:
                logger.warning("the zygote could not start %s (%s); starting a fresh process", target, exc)
    return subprocess.Popen([*program, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)


class RunTimeout(RunFailed, TimeoutError):
    """What a peer was waited for (a line it prints, a file it writes) did not come in time, or it exited first."""


class PeerProcess:
    """One ``hlbp`` process in its own session, whose combined output is collected line by line."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], log: Path | None = None,
                 program: Sequence[str] | None = None, zygote: Zygote | None = None) -> None:
        self.name, self.args = name, args
        self.popen: subprocess.Popen[str] | ForkedProcess = _start(list(program or HLBP_PROGRAM), args, env, zygote)
        self.lines: list[str] = []
        self.eof = False  # the process closed its output: no more lines will come
        self._log = open(log, "a", encoding="utf-8") if log is not None else None  # noqa: SIM115 - closed by pump
        self._cond = threading.Condition()
        threading.Thread(target=self._pump, name=f"pump-{name}", daemon=True).start()

    def _pump(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            if self._log is not None:
                self._log.write(line)
                self._log.flush()
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        if self._log is not None:
            self._log.close()
        with self._cond:
            self.eof = True
            self._cond.notify_all()

    @property
    def output(self) -> str:
        with self._cond:
            return "\n".join(self.lines)

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def find(self, pattern: str) -> list[re.Match[str]]:
        """Every output line so far that matches ``pattern``."""
        regex = re.compile(pattern)
        with self._cond:
            return [m for m in (regex.search(line) for line in self.lines) if m]

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        """The first output line matching ``pattern``; raises :class:`RunTimeout` with the output if none comes
        in time or the process ends first."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self.lines:
                    match = regex.search(line)
                    if match:
                        return match
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self.eof:
                    raise RunTimeout(f"{self.name}: no line matching {pattern!r} (exit {self._exit_code()}):\n"
                                       + "\n".join(self.lines[-40:]))
                self._cond.wait(min(remaining, 0.5))

    def _exit_code(self) -> int | None:
        """The exit status; a process that closed its output is given a moment to end, so the message says how
        it ended (None: still running)."""
        if self.eof:
            try:
                return self.popen.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                return None
        return self.popen.poll()

    def kill(self) -> None:
        """SIGKILL the whole session: the main process, its DHT process and p2pd."""
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass  # a zombie the kernel reaps with us; nothing is left running

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM to the main process (it saves and marks itself offline), SIGKILL after ``timeout``.

        The session is killed in either case afterwards, so helpers a clean exit left behind do not linger.
        Returns the main process's exit status (None if it had to be killed).
        """
        rc: int | None = None
        if self.popen.poll() is None:
            try:
                self.popen.send_signal(signal.SIGTERM)
                rc = self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                rc = None
        else:
            rc = self.popen.returncode
        self.kill()
        return rc


@dataclass
class Replica:
    """A replica's process, its identity file and its metrics directory (known once it has connected)."""

    name: str
    identity: Path
    out_dir: Path
    proc: PeerProcess
    peer_id: str = ""

    def metrics_path(self) -> Path | None:
        """``OUT/<run>/<last 12 chars of the peer id>/metrics.jsonl``, once the peer id is known."""
        if not self.peer_id:
            match = self.proc.find(r"^connected as (\S+)")
            if not match:
                return None
            self.peer_id = match[0].group(1)
        found = list(self.out_dir.glob(f"*/{self.peer_id[-12:]}/metrics.jsonl"))
        return found[0] if found else None

    def rounds(self) -> list[dict[str, Any]]:
        """This peer's round records so far (empty before the first round)."""
        return self.events("round")

    def events(self, event: str) -> list[dict[str, Any]]:
        """This peer's records of ``event`` in its ``metrics.jsonl`` so far (empty before it wrote one)."""
        path = self.metrics_path()
        if path is None or not path.exists():
            return []
        return [r for r in read_metrics(path) if r.get("event") == event]


@dataclass
class Swarm:
    """A bootstrap plus replicas under ``workdir``; use as a context manager so every process is reaped."""

    cfg: SimConfig
    workdir: Path
    env: dict[str, str] = field(default_factory=dict)
    bootstrap: PeerProcess | None = None
    maddr: str = ""
    replicas: dict[str, Replica] = field(default_factory=dict)
    wan: WanEmulator | None = None
    _all: list[PeerProcess] = field(default_factory=list)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, program: Sequence[str] | None = None, listen: str | None = None) -> str:
        """Start the bootstrap; returns the multiaddr joiners dial. ``program`` runs it under another command (in a
        network namespace, say) and ``listen`` is its listen multiaddr there (default: any loopback port)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1",
                    allocator.ENV_CHOICE: allocator.for_children(os.environ), **self.env}
        if self.cfg.cache_dir is not None:
            self.env["HLBP_CACHE"] = str(self.cfg.cache_dir)
        run = self.workdir / "run.toml"
        run.write_text(self.cfg.run_toml(), encoding="utf-8")
        if (self.cfg.wan_delay_ms > 0 or self.cfg.wan_mbps is not None or self.cfg.swarm_wan_delay_ms is not None
                or self.cfg.swarm_wan_mbps is not None):
            self.wan = WanEmulator(self.cfg.wan_delay_ms / 1000, self.cfg.wan_mbps)
        self.bootstrap = self._spawn("bootstrap", [
            "bootstrap", *self._listen(listen=listen), "--identity", str(self.workdir / "bootstrap.key"),
            "--run-config", str(run), "--ttl", str(self.cfg.ttl_s)], program)
        self.maddr = self.bootstrap.wait_for(r"hlbp join --initial-peers (\S+)", self.cfg.startup_timeout_s).group(1)
        return self.maddr

    def _listen(self, stage: bool = False, listen: str | None = None) -> list[str]:
        """Listen flags of a new process: ``listen`` where given, else any loopback port, or a private port behind
        a WAN-emulating proxy (a stage peer's with the swarms' link settings where they are set)."""
        if listen is not None:
            return ["--host-maddrs", listen]
        if self.wan is None:
            return ["--host-maddrs", LOOPBACK]
        port = free_port()
        delay = self.cfg.swarm_wan_delay_ms if stage and self.cfg.swarm_wan_delay_ms is not None \
            else self.cfg.wan_delay_ms
        rate = self._rate_mbps(stage)
        return ["--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}",
                "--announce-maddrs", f"/ip4/127.0.0.1/tcp/{self.wan.add(port, delay_s=delay / 1000, rate_mbps=rate)}"]

    def _rate_mbps(self, stage: bool) -> float | None:
        """The emulated link rate of a new process (a stage peer's with the swarms' setting where it is set)."""
        return self.cfg.swarm_wan_mbps if stage and self.cfg.swarm_wan_mbps is not None else self.cfg.wan_mbps

    def _bandwidth(self, stage: bool) -> float:
        """The bytes/s a new process announces: its emulated link's rate where one limits it, else 100 MB/s."""
        rate = self._rate_mbps(stage)
        return rate * 1e6 / 8 if self.wan is not None and rate is not None else 1e8

    def _spawn(self, name: str, args: list[str], program: Sequence[str] | None = None) -> PeerProcess:
        proc = PeerProcess(name, args, self.env, log=self.workdir / f"{name}.log", program=program,
                           zygote=shared_zygote() if self.cfg.fork else None)
        self._all.append(proc)
        return proc

    def _join(self, name: str, role_flags: list[str], program: Sequence[str] | None,
              listen: str | None = None) -> Replica:
        """Start (or restart, reusing its identity and out-dir) ``hlbp join`` peer ``name`` with ``role_flags``,
        listening on ``listen`` (see :meth:`_listen`)."""
        old = self.replicas.get(name)
        identity = old.identity if old else self.workdir / f"{name}.key"
        out_dir = old.out_dir if old else self.workdir / name
        args = ["join", "--initial-peers", self.maddr, *self._listen("--stage" in role_flags, listen), "--identity", str(identity),
                "--bandwidth", f"{self._bandwidth('--stage' in role_flags):g}", "--reachability", "public",
                "--threads", str(self.cfg.threads),
                "--out-dir", str(out_dir), "--ttl", str(self.cfg.ttl_s), *role_flags]
        if self.cfg.checkpoint_every_s is not None:
            args += ["--checkpoint-every", str(self.cfg.checkpoint_every_s)]
        if self.cfg.state_dtype is not None:
            args += ["--state-dtype", self.cfg.state_dtype]
        if self.cfg.state_on_disk is not None:
            args += ["--state-on-disk" if self.cfg.state_on_disk else "--state-in-memory"]
        if self.cfg.recompute:
            args.append("--recompute")
        peer = Replica(name, identity, out_dir, self._spawn(name, args, program), old.peer_id if old else "")
        self.replicas[name] = peer
        return peer

    def add(self, name: str, *extra: str, rounds: int | None = None, program: Sequence[str] | None = None,
            listen: str | None = None) -> Replica:
        """Start (or restart, reusing its identity and out-dir) replica ``name`` with extra ``hlbp join`` flags.

        ``program`` replaces the command that runs ``join`` (a fault test's entry point with a fault hook, or
        ``ip netns exec NS python -m hlbp.cli.control_cmds``); ``listen``: its listen multiaddr."""
        return self._join(name, ["--role", "replica", "--throughput", "5000",
                                 "--rounds", str(self.cfg.rounds if rounds is None else rounds), *extra], program,
                          listen)

    def add_stage(self, name: str, stage: int, *extra: str, max_steps: int | None = None,
                  program: Sequence[str] | None = None, swarm: int | None = None,
                  listen: str | None = None) -> Replica:
        """Start (or restart) stage peer ``name`` holding ``stage`` (stage 0 drives its swarm); ``max_steps``: the
        driver leaves after that many inner steps, a server after applying that many; ``swarm``: join that swarm
        (``--swarm``) instead of where the role policy puts a peer of that stage."""
        steps = ["--max-steps", str(max_steps)] if max_steps is not None else []
        where = ["--swarm", str(swarm)] if swarm is not None else []
        # every stage peer announces the same forced rate (no warm-up) while sharing this machine's cores, so a
        # driver's measured rate against that number says nothing: no switch to a "faster" standby unless a test
        # asks for one (a later --switch-factor in ``extra`` wins)
        return self._join(name, ["--role", "stage", "--stage", str(stage), *where, "--throughput", "1000",
                                 "--switch-factor", "0", *steps, *extra], program, listen)

    def records(self) -> dict[str, list[dict[str, Any]]]:
        """Every replica's round records so far, by replica name."""
        return {name: r.rounds() for name, r in self.replicas.items()}

    def wait(self, fn: Callable[[], Any], what: str, timeout: float = ROUNDS_WAIT_S) -> Any:
        """:func:`poll` for ``fn``; a timeout names ``what`` and quotes the end of every replica's output."""
        return poll(fn, timeout, lambda: what + "\n" + "\n".join(f"--- {n}\n{r.proc.output[-2500:]}"
                                                                  for n, r in self.replicas.items()))

    def close(self) -> None:
        """Stop every process this swarm started: replicas first (SIGTERM, then SIGKILL), the bootstrap last."""
        procs = [p for p in self._all if p is not self.bootstrap]
        for proc in procs:
            if proc.alive:
                try:
                    proc.popen.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + self.cfg.stop_timeout_s
        for proc in procs:
            try:
                proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            proc.kill()
        if self.bootstrap is not None:
            self.bootstrap.stop(self.cfg.stop_timeout_s)
        if self.wan is not None:
            self.wan.close()


def poll(fn: Callable[[], Any], timeout: float, what: str | Callable[[], str], interval: float = 0.25) -> Any:
    """Call ``fn`` until it returns something truthy; raises :class:`RunTimeout` naming ``what`` after ``timeout``.
    ``what`` may be a function, called only then: a description that quotes a process's output must quote it as
    it is at the timeout, not as it was when the wait began."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            told = what() if callable(what) else what
            raise RunTimeout(f"timed out after {timeout:.0f} s waiting for {told}; last value: {value!r}")
        time.sleep(interval)  # the polling interval, bounded by the deadline above


# ---------------------------------------------------------------------------------------------------------------
# The summary: a pure function of the metrics records
# ---------------------------------------------------------------------------------------------------------------
