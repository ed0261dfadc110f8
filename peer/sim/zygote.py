"""Start local ``hlbp`` processes by forking a warm interpreter (a zygote) instead of starting a fresh one.

Every ``hlbp join`` spends 3-7 CPU-seconds importing torch, hivemind and ``torch._dynamo`` (the first AdamW step
imports it) before it does anything. A simulated swarm starts a dozen such processes on one machine, and the test
suite hundreds, so on a 2-core box process start was the largest single cost. The zygote imports them once, then
forks a child per process, which starts with them loaded.

A child behaves as ``subprocess.Popen(start_new_session=True)`` would start it:

- it is a real process in its own session, so ``os.killpg`` kills it whole with its DHT process and p2pd, the
  way a spot instance dies;
- its stdout and stderr go to a pipe the caller reads, and it gets the caller's argv, environment and working
  directory;
- it exits as a fresh interpreter does (atexit handlers run), and the caller sees its exit status, negative for
  the signal that killed it.

What differs: the child's parent is the zygote, which reaps it and reports its status (within 0.05 s). An
environment variable read at import time is read with the zygote's environment; hlbp reads its ``HLBP_*``
variables when a command runs.

Fork safety: the zygote forks from its only Python thread and never runs a torch op, so no thread pool or lock is
copied while in use. This is the same situation as torch's DataLoader workers, which fork after those imports. A
zygote whose imports started a Python thread refuses to serve, and the caller starts fresh processes instead.

The channel is a local socket pair between the caller and the zygote it started; messages are JSON, never pickle.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import select
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

import setproctitle

logger = logging.getLogger(__name__)

PRELOAD = (  # what `hlbp join`, `hlbp bootstrap` and the fault tests' peers import before their first step
    "torch",
    "torch._dynamo",
    "hivemind",
    "hlbp.cli.control_cmds",
    "hlbp.bootstrap.node",
    "hlbp.peer.net.control",
    "hlbp.peer.node.join",
    "hlbp.peer.node.replica",
    "hlbp.peer.node.stage",
)
MAX_MESSAGE = 1 << 20  # a request carries argv and the environment: far below this
TITLE_ROOM = 4096  # bytes of argv the zygote starts with, for its children's command lines (setproctitle)
POLL_S = 0.05  # how often the zygote reaps exited children while no request comes


# -- the zygote process --------------------------------------------------------------------------------------


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.send(json.dumps(message).encode())


def _reap(sock: socket.socket) -> None:
    """Report every child that exited since the last call: {"exit": pid, "code": Popen-style returncode}."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _own_locks() -> None:
    """Give the child its own copies of the process-shared locks that hivemind creates at import time.

    Otherwise every child of the zygote would share them: a peer SIGKILLed while it holds one (they guard each
    DHT call's future) would hang every other peer. A fresh interpreter creates its own; hivemind's DHT process,
    forked from its peer, still shares its peer's, as hivemind means it to. Not registered with
    ``os.register_at_fork``, which would also run in that DHT process.
    """
    mpfuture = sys.modules.get("hivemind.utils.mpfuture")
    if mpfuture is not None:
        mpfuture.MPFuture.reset_backend()  # MPFuture's two locks and SharedBytes's, hivemind's own reset
    hm_asyncio = sys.modules.get("hivemind.utils.asyncio")
    if hm_asyncio is not None:
        import multiprocessing

        hm_asyncio._AsyncContextWrapper.EXECUTOR_LOCK = multiprocessing.Lock()


def _become(request: dict[str, Any], out: int) -> None:
    """In the forked child: take the request's output pipe, session, environment, directory and argv. The caller
    then runs the program; an error here ends the child at once (it must never return to the zygote's loop)."""
    try:
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)  # the zygote's sys.stdout and sys.stderr (unbuffered) now write to the pipe
        os.close(out)
        os.close(null)
        os.environ.clear()  # (setproctitle moved the C environment aside when the zygote started)
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        sys.argv = [request["target"], *request["args"]]
        if request["kind"] == "path":
            sys.path[0] = str(Path(request["target"]).resolve().parent)  # as `python script.py` sets it
        _own_locks()
        # ps and /proc/PID/cmdline show the command it runs, not the zygote's: how a user (or the Ctrl-C test)
        # tells the peers apart
        prefix = [sys.executable, "-m"] if request["kind"] == "module" else [sys.executable]
        setproctitle.setproctitle(" ".join([*prefix, request["target"], *request["args"]]))
    except BaseException as exc:  # noqa: BLE001 - nothing may unwind into the zygote's loop
        os.write(2, f"zygote: could not start the child: {exc!r}\n".encode())
        os._exit(127)


def _run(request: dict[str, Any]) -> None:
    """Run the request's program as ``python -m MODULE`` or ``python PATH`` would. Its SystemExit (or any other
    exception) unwinds out of :func:`serve` and ends this interpreter the usual way: atexit handlers, the exit
    status, a traceback for an uncaught exception."""
    import runpy

    if request["kind"] == "module":
        # as under `python -m`, the module runs as __main__ and is not imported under its own name (which would
        # make runpy warn that it was)
        sys.modules.pop(request["target"], None)
        runpy.run_module(request["target"], run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(request["target"], run_name="__main__")
    sys.exit(0)


def serve(fd: int, preload: tuple[str, ...] = PRELOAD) -> None:
    """The zygote: import ``preload``, then fork one child per request on the socket ``fd`` until the caller
    closes it."""
    sock = socket.socket(fileno=fd)
    try:
        for name in preload:
            __import__(name)
    except Exception as exc:  # noqa: BLE001 - the caller falls back to fresh processes and says why
        _send(sock, {"ready": False, "why": f"preloading failed: {exc!r}"})
        return
    if threading.active_count() != 1:
        _send(sock, {"ready": False, "why": f"preloading started {threading.active_count() - 1} Python thread(s); "
                                           "forking now could copy a lock in use"})
        return
    setproctitle.setproctitle(f"hlbp zygote: forks the processes of {os.getppid()}")  # also sets up the title
    # area (the argv with its padding argument, and the environment) while both are intact
    _send(sock, {"ready": True})
    while True:
        readable, _, _ = select.select([sock], [], [], POLL_S)
        _reap(sock)
        if not readable:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 1)
        except OSError:
            return
        if not data:
            for fd_ in fds:
                os.close(fd_)
            return  # the caller is gone; children live on in their own sessions, as Popen's would
        request = json.loads(data)
        if len(fds) != 1:
            for fd_ in fds:
                os.close(fd_)
            _send(sock, {"id": request.get("id"), "error": "a request must carry exactly one output descriptor"})
            continue
        started, child_ready = os.pipe()
        pid = os.fork()
        if pid == 0:
            sock.close()
            os.close(started)
            _become(request, fds[0])
            os.close(child_ready)  # in its own session now: the caller may signal its group
            _run(request)
        os.close(fds[0])
        os.close(child_ready)
        os.read(started, 1)  # EOF once the child closed its end (or died): as Popen returns after the exec
        os.close(started)
        _send(sock, {"id": request["id"], "pid": pid})


# -- the caller's side ---------------------------------------------------------------------------------------


class ZygoteError(RuntimeError):
    """The zygote could not start or serve; the caller starts fresh processes instead."""


class ForkedProcess:
    """A child of the zygote, with the part of ``subprocess.Popen``'s interface the launcher and tests use."""

    def __init__(self, zygote: Zygote, pid: int, args: list[str], stdout: IO[str]) -> None:
        self._zygote = zygote
        self.pid = pid
        self.args = args
        self.stdout = stdout
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid, 0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid, timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(15)

    def kill(self) -> None:
        self.send_signal(9)


class Zygote:
    """A started zygote process and the caller's end of its socket (thread-safe)."""

    def __init__(self, preload: tuple[str, ...] = PRELOAD, ready_timeout_s: float = 180.0) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hlbp.peer.sim.zygote", str(theirs.fileno()), " " * TITLE_ROOM, *preload],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL, start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        theirs.close()
        self.sock = mine
        self._cond = threading.Condition()
        self._send_lock = threading.Lock()
        self._replies: dict[int, dict[str, Any]] = {}
        self._exits: dict[int, int] = {}
        self._next = 0
        self.alive = True
        self.sock.settimeout(ready_timeout_s)
        try:
            first = json.loads(self.sock.recv(MAX_MESSAGE) or b"{}")
        except (OSError, ValueError) as exc:
            self.close()
            raise ZygoteError(f"the zygote did not start: {exc!r}") from exc
        if not first.get("ready"):
            self.close()
            raise ZygoteError(first.get("why", "the zygote exited while preloading"))
        self.sock.settimeout(None)
        threading.Thread(target=self._listen, name="zygote-listen", daemon=True).start()

    def _listen(self) -> None:
        while True:
            try:
                data = self.sock.recv(MAX_MESSAGE)
            except OSError:
                data = b""
            with self._cond:
                if not data:
                    self.alive = False
                    self._cond.notify_all()
                    return
                message = json.loads(data)
                if "exit" in message:
                    self._exits[int(message["exit"])] = int(message["code"])
                else:
                    self._replies[int(message["id"])] = message
                self._cond.notify_all()

    def spawn(self, kind: str, target: str, args: list[str], env: dict[str, str],
              timeout_s: float = 60.0) -> ForkedProcess:
        """Fork a child that runs module ``target`` (``kind="module"``) or script ``target`` (``"path"``) with
        ``args``; its combined output is the returned process's ``stdout``."""
        read, write = os.pipe()
        try:
            with self._cond:
                self._next += 1
                ident = self._next
            request = {"id": ident, "kind": kind, "target": target, "args": args, "env": env, "cwd": os.getcwd()}
            with self._send_lock:
                socket.send_fds(self.sock, [json.dumps(request).encode()], [write])
        except OSError as exc:
            os.close(read)
            raise ZygoteError(f"the zygote is gone: {exc!r}") from exc
        finally:
            os.close(write)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while ident not in self._replies:
                remaining = deadline - time.monotonic()
                if not self.alive or remaining <= 0:
                    os.close(read)
                    raise ZygoteError("the zygote did not fork the process")
                self._cond.wait(remaining)
            reply = self._replies.pop(ident)
        if "pid" not in reply:
            os.close(read)
            raise ZygoteError(reply.get("error", "the zygote refused the request"))
        stdout = open(read, encoding="utf-8", errors="replace")  # noqa: SIM115 - the reader closes it at EOF
        return ForkedProcess(self, int(reply["pid"]), [target, *args], stdout)

    def exit_code(self, pid: int, timeout: float | None) -> int | None:
        """The exit status of child ``pid`` once the zygote reaped it; None if it did not exit within ``timeout``
        (None: wait for ever). If the zygote itself died, a child that no longer runs reads as SIGKILLed, since
        its real status went to whoever reaped it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while pid not in self._exits:
                if not self.alive and not Path(f"/proc/{pid}").exists():
                    logger.warning("the zygote died before reporting how process %d exited", pid)
                    self._exits[pid] = -9
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                # a dead zygote reports nothing more: look at /proc again shortly
                self._cond.wait(remaining if self.alive else min(POLL_S, remaining or POLL_S))
            return self._exits[pid]

    def close(self) -> None:
        """Close our end: the zygote exits (its running children do not)."""
        try:
            with contextlib.suppress(OSError):  # wakes our listener's recv, which would keep the socket open
                self.sock.shutdown(socket.SHUT_RDWR)
            self.sock.close()
        finally:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


_shared: Zygote | None = None
_shared_lock = threading.Lock()
_refused: str | None = None  # why the last zygote could not start; then nobody tries again in this process


def shared_zygote() -> Zygote | None:
    """This process's zygote, started on first use (one per process, shared by every swarm it starts); None when
    one could not start here, after a warning that says why."""
    global _shared, _refused
    with _shared_lock:
        if _shared is not None and _shared.alive and _shared.proc.poll() is None:
            return _shared
        if _refused is not None:
            return None
        try:
            _shared = Zygote()
        except (ZygoteError, OSError) as exc:  # OSError: no SOCK_SEQPACKET socket pairs here (macOS)
            _refused = str(exc)
            logger.warning("starting processes without a zygote (each imports torch itself): %s", exc)
            return None
        atexit.register(_shared.close)
        return _shared


if __name__ == "__main__":
    serve(int(sys.argv[1]), tuple(sys.argv[3:]))  # argv[2]: room for the children's titles
