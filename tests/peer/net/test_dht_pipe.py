"""The DHT's command pipe: messages arrive whole and in order, and a dead DHT process fails a send instead of
hanging it (this process holds both ends of the pipe, so nothing else would ever end the wait)."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

import pytest

from hlbp.peer.net.dht import DHT_DIED, CommandPipe


def test_messages_of_every_size_arrive_whole_and_in_order_for_the_pipes_own_recv() -> None:
    inner, outer = mp.Pipe(duplex=False)
    pipe = CommandPipe(outer, alive=lambda: True)
    messages = [("_get", [], {"key": "k", "value": b"x" * n}) for n in (0, 10, 4095, 4097, 70_000, 300_000)]
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.extend(inner.recv() for _ in messages))
    reader.start()
    for m in messages:
        pipe.send(m)
    reader.join(timeout=30)
    assert got == messages


def test_a_send_into_a_pipe_nobody_drains_raises_once_the_dht_process_is_dead() -> None:
    inner, outer = mp.Pipe(duplex=False)  # ``inner`` is never read: the DHT process is hung, then dead
    alive = threading.Event()
    alive.set()
    pipe = CommandPipe(outer, alive=alive.is_set)
    errors: list[BaseException] = []

    def send() -> None:
        try:
            pipe.send(("_store", [], {"value": b"y" * 200_000}))  # more than the pipe holds: the write waits
        except ConnectionError as exc:
            errors.append(exc)

    writers = [threading.Thread(target=send) for _ in range(2)]  # the second waits for the first's lock
    for w in writers:
        w.start()
    time.sleep(1.0)
    assert all(w.is_alive() for w in writers)  # a slow DHT process is waited for
    alive.clear()
    started = time.monotonic()
    for w in writers:
        w.join(timeout=10)
    assert not any(w.is_alive() for w in writers)
    assert time.monotonic() - started < 5
    assert [str(e) for e in errors] == [DHT_DIED, DHT_DIED]
    with pytest.raises(ConnectionError):
        pipe.send(("_get", [], {}))
    inner.close()


def test_a_failure_to_pass_a_handle_to_the_dht_process_is_one_line_and_other_errors_keep_their_hook(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import multiprocessing.resource_sharer as sharer
    import sys

    from hlbp.peer.net.dht import quiet_handle_passing

    seen: list[type[BaseException]] = []
    monkeypatch.setattr(sys, "excepthook", lambda kind, exc, tb: seen.append(kind))
    quiet_handle_passing()
    quiet_handle_passing()  # once only: the hook is not wrapped twice
    for code, kind in ((compile("raise EOFError('the DHT process died')", sharer.__file__, "exec"), EOFError),
                       (compile("raise ValueError('elsewhere')", "elsewhere.py", "exec"), ValueError)):
        try:
            exec(code, {})  # noqa: S102 - our own code object, compiled to raise from a resource_sharer frame
        except kind:
            sys.excepthook(*sys.exc_info())
    assert seen == [ValueError]  # the handle-passing thread's failure went to the log, the other to the old hook
    assert "passing a handle to the DHT process failed: EOFError" in caplog.text
