"""hivemind's ``DHT``, made safe for records above 4 KiB, for calls from several threads, and for its own death.

Why a module of its own: every node (bootstrap, replica, benchmark) starts its DHT through :class:`SafeDHT`, and
the workaround touches two private attributes of hivemind's class, which belongs in one place.
"""

from __future__ import annotations

import logging
import os
import select
import struct
import sys
import threading
import traceback
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from types import TracebackType
from typing import Any

import hivemind

_CHECK_S = 0.5  # how often a waiting send asks whether the DHT process lives
# The environment our p2pd runs with. go-libp2p's TCP transport dials out from its listening port (SO_REUSEPORT)
# unless told not to. Two peers dialling each other at the same moment (a round's records pushed both ways) then
# make one TCP connection by simultaneous open, on which both sides speak first: the security handshake fails on
# both, and each side puts the other in dial backoff (5 s and more), so neither reaches the other in that time. On
# loopback, 3 of 20 pairs of simultaneous dials failed this way, and none of 40 with the port reuse off. hlbp does
# no hole punching, the one thing the reuse is for.
P2PD_ENV = {"LIBP2P_TCP_REUSEPORT": "false"}
DHT_DIED = "the DHT process of this peer died; restart the peer (a replica resumes from its checkpoint)"


class CommandPipe:
    """The caller's end of a DHT's command pipe: whole messages, one writer at a time, and no write that outlives
    the DHT process.

    Why not the pipe's own ``send``: this process holds both ends of the pipe, so writing to a dead DHT process
    neither fails nor gets an answer; it fills the pipe (64 KiB) until a blocking write waits for ever, holding the
    lock every other caller then waits on. Here the end is non-blocking and every wait (for the lock, for room in
    the pipe) checks each ``_CHECK_S`` that the DHT process lives, so a death mid-message raises ``ConnectionError``.
    Messages are framed exactly as ``multiprocessing.connection.Connection`` frames them, so the DHT process reads
    them with the pipe's own ``recv``.
    """

    def __init__(self, conn: Any, alive: Callable[[], bool]) -> None:
        self._conn = conn
        self._alive = alive
        self._owner = os.getpid()  # only the DHT's parent may ask whether it lives (hivemind's averager forks)
        self._lock = threading.Lock()

    def _check(self) -> None:
        if os.getpid() == self._owner and not self._alive():
            raise ConnectionError(DHT_DIED)

    def send(self, obj: Any) -> None:
        self._check()
        frame = frame_message(ForkingPickler.dumps(obj))
        while not self._lock.acquire(timeout=_CHECK_S):
            self._check()
        try:
            self._write(frame)
        finally:
            self._lock.release()

    def _write(self, frame: bytes) -> None:
        fd = self._conn.fileno()
        os.set_blocking(fd, False)
        view = memoryview(frame)
        while view:
            try:
                view = view[os.write(fd, view):]
            except BlockingIOError:
                select.select([], [fd], [], _CHECK_S)
                self._check()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


def frame_message(payload: bytes) -> bytes:
    """``payload`` with the length header ``multiprocessing.connection.Connection.recv_bytes`` reads."""
    if len(payload) > 0x7FFFFFFF:
        return struct.pack("!i", -1) + struct.pack("!Q", len(payload)) + payload
    return struct.pack("!i", len(payload)) + payload


class _WholeMessagePipe:
    """The DHT process's end of the command pipe, reading every message whole."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn

    def recv(self) -> Any:
        # uvloop's add_reader made the fd non-blocking; poll() said a message has begun, and its writer is
        # finishing it: wait for the rest instead of failing with EAGAIN halfway through
        fd = self._conn.fileno()
        os.set_blocking(fd, True)
        try:
            return self._conn.recv()
        finally:
            os.set_blocking(fd, False)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


def quiet_handle_passing() -> None:
    """Report in one line, not a traceback, a failure of the thread through which this process passes file handles
    to its DHT process (``multiprocessing.resource_sharer``, which hands errors to ``sys.excepthook``): it fails
    only when the DHT process died while taking a handle, and the round loop then says so itself."""
    if getattr(sys.excepthook, "hlbp_quiet", False):
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        frames = traceback.extract_tb(tb)
        if any(f.filename.endswith(os.path.join("multiprocessing", "resource_sharer.py")) for f in frames):
            logging.getLogger(__name__).warning("passing a handle to the DHT process failed: %s: %s",
                                                kind.__name__, exc)
            return
        previous(kind, exc, tb)

    hook.hlbp_quiet = True  # type: ignore[attr-defined]
    sys.excepthook = hook


class SafeDHT(hivemind.DHT):
    """hivemind's ``DHT``, safe for records above 4 KiB and for several calling threads.

    Why: every call crosses one OS pipe into the DHT process. A message above PIPE_BUF (4 KiB: a round record of
    many members, a large value) is written in pieces; hivemind reads it from a non-blocking fd, so a reader that
    wakes between two pieces fails with EAGAIN, loses its place in the stream and the DHT process dies. Two threads
    writing at once (our round runner, heartbeat, hivemind's averager) interleave their pieces with the same end.
    Here writes are serialised and the DHT process waits for the rest of a message it has begun to read.
    """

    def __init__(self, *args: Any, start: bool, await_ready: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, start=False, **kwargs)
        quiet_handle_passing()
        if start:
            self.run_in_background(await_ready=await_ready)
        # wrapped once the DHT process runs, so the lock never has to cross into it (spawn pickles the object)
        self._outer_pipe = CommandPipe(self._outer_pipe, self.is_alive)

    def run(self) -> None:  # runs in the DHT process
        os.environ.update(P2PD_ENV)  # this process starts the p2pd, which inherits its environment
        self._inner_pipe = _WholeMessagePipe(self._inner_pipe)
        super().run()
