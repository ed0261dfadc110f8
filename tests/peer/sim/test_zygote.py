"""Processes forked from the zygote behave as the fresh ``Popen(start_new_session=True)`` processes they replace.

These tests use a zygote that preloads nothing (it starts in a fraction of a second); the preloading one starts
every peer of the network tests, which check the rest end to end.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hlbp.peer.sim.launcher import PeerProcess
from hlbp.peer.sim.zygote import Zygote, ZygoteError

SCRIPT = textwrap.dedent("""
    import atexit, os, signal, sys, time
    atexit.register(lambda: print("atexit ran", flush=True))
    print("argv", sys.argv[1:], "env", os.environ.get("ZYG_TEST"), "cwd", os.getcwd(), "sid", os.getsid(0) == os.getpid())
    print("stdin", repr(sys.stdin.read()))
    mode = sys.argv[1]
    if mode == "exit":
        sys.exit(int(sys.argv[2]))
    if mode == "raise":
        raise ValueError("boom")
    if mode == "sleep":
        print("sleeping", flush=True)
        time.sleep(60)
""")


@pytest.fixture
def zygote() -> Iterator[Zygote]:
    z = Zygote(preload=())
    yield z
    z.close()


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "child.py"
    path.write_text(SCRIPT, encoding="utf-8")
    return str(path)


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, **extra}


def test_a_child_gets_argv_env_cwd_its_own_session_and_exits_with_its_status(zygote: Zygote, script: str,
                                                                             tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    proc = zygote.spawn("path", script, ["exit", "3"], _env(ZYG_TEST="seen"))
    out = proc.stdout.read()
    assert proc.wait(30) == 3 and proc.returncode == 3 and proc.poll() == 3
    assert f"argv ['exit', '3'] env seen cwd {tmp_path} sid True" in out, out
    assert "stdin ''" in out and "atexit ran" in out, out  # stdin is empty; the interpreter exits the usual way


def test_an_uncaught_exception_exits_1_with_its_traceback(zygote: Zygote, script: str) -> None:
    proc = zygote.spawn("path", script, ["raise"], _env())
    out = proc.stdout.read()
    assert proc.wait(30) == 1
    assert "ValueError: boom" in out and "atexit ran" in out, out


def test_signals_timeouts_and_killing_the_session(zygote: Zygote, script: str) -> None:
    proc = zygote.spawn("path", script, ["sleep"], _env())
    assert proc.stdout.readline().startswith("argv")
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.2)
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == -signal.SIGTERM
    other = zygote.spawn("path", script, ["sleep"], _env())
    assert os.getsid(other.pid) == other.pid  # killpg, as PeerProcess.kill does, reaches it and its children
    os.killpg(other.pid, signal.SIGKILL)
    assert other.wait(30) == -signal.SIGKILL
    other.send_signal(signal.SIGTERM)  # after it exited: a no-op, as Popen's


def test_a_module_runs_as_python_m_does(zygote: Zygote) -> None:
    proc = zygote.spawn("module", "calendar", ["2026", "11"], _env())
    out = proc.stdout.read()
    assert proc.wait(30) == 0 and "November 2026" in out and "23 24 25" in out, out


def test_peerprocess_runs_a_script_through_the_zygote_and_falls_back_for_other_programs(zygote: Zygote,
                                                                                          script: str) -> None:
    forked = PeerProcess("forked", ["exit", "0"], _env(), program=[sys.executable, script], zygote=zygote)
    fresh = PeerProcess("fresh", ["-c", "print('fresh')"], _env(), program=[sys.executable], zygote=zygote)
    assert forked.popen.wait(30) == 0 and fresh.popen.wait(30) == 0
    assert type(forked.popen).__name__ == "ForkedProcess" and isinstance(fresh.popen, subprocess.Popen)
    deadline = time.monotonic() + 30
    while not (forked.eof and fresh.eof) and time.monotonic() < deadline:
        time.sleep(0.05)  # the pump threads' end, bounded by the deadline
    assert "atexit ran" in forked.output and fresh.output == "fresh"


def test_a_dead_zygote_refuses_requests_and_its_orphans_still_end(zygote: Zygote, script: str) -> None:
    proc = zygote.spawn("path", script, ["sleep"], _env())
    assert proc.stdout.readline().startswith("argv")
    zygote.proc.kill()
    zygote.proc.wait(30)
    deadline = time.monotonic() + 30
    while zygote.alive and time.monotonic() < deadline:
        time.sleep(0.05)  # the listener's EOF, bounded by the deadline
    with pytest.raises(ZygoteError):
        zygote.spawn("path", script, ["exit", "0"], _env())
    assert proc.poll() is None  # the child still runs in its own session
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL  # its real status went to init: reported as killed


def test_children_do_not_share_hivemind_locks(tmp_path: Path) -> None:
    """A peer SIGKILLed while it holds one of hivemind's process-shared locks must not hang the others."""
    holder = tmp_path / "holder.py"
    holder.write_text("from hivemind.utils.mpfuture import SharedBytes\nimport time\nSharedBytes._lock.acquire()\n"
                      "print('holding', flush=True)\ntime.sleep(60)\n", encoding="utf-8")
    taker = tmp_path / "taker.py"
    taker.write_text("from hivemind.utils.mpfuture import SharedBytes\n"
                     "print('took' if SharedBytes._lock.acquire(timeout=5) else 'blocked', flush=True)\n",
                     encoding="utf-8")
    z = Zygote(preload=("hivemind",))
    try:
        first = z.spawn("path", str(holder), [], _env())
        assert first.stdout.readline().strip() == "holding"
        os.killpg(first.pid, signal.SIGKILL)  # dies holding it
        assert first.wait(30) == -signal.SIGKILL
        second = z.spawn("path", str(taker), [], _env())
        assert second.stdout.read().strip() == "took" and second.wait(30) == 0
    finally:
        z.close()


def test_a_child_shows_its_own_command_line(zygote: Zygote, script: str) -> None:
    long = "/a/long/path" * 150  # 1,800 characters: longer than the whole environment of a bare CI shell
    proc = zygote.spawn("path", script, ["sleep", "--out-dir", long], _env())
    assert proc.stdout.readline().startswith("argv")
    cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    assert f"{sys.executable} {script} sleep --out-dir {long}" in cmdline, cmdline
    zygote_line = Path(f"/proc/{zygote.proc.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    assert zygote_line.strip() == f"hlbp zygote: forks the processes of {os.getpid()}", zygote_line
    proc.kill()
    assert proc.wait(30) == -signal.SIGKILL


def test_a_zygote_that_cannot_preload_says_why() -> None:
    with pytest.raises(ZygoteError, match="preloading failed.*no_such_module_for_the_zygote"):
        Zygote(preload=("no_such_module_for_the_zygote",))
