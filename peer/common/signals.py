"""How a long-running hlbp process (a bootstrap, a joined peer) learns that it should stop: SIGTERM and SIGINT."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any


def stop_on_signals(stop: threading.Event, interrupt: threading.Event | None = None) -> None:
    """SIGTERM and SIGINT set ``stop``; while ``interrupt`` is set they also raise KeyboardInterrupt in the main
    thread, to cut short work (local training) that does not poll ``stop``."""

    main_pid = os.getpid()

    def handler(signum: int, _frame: Any) -> None:
        if os.getpid() != main_pid:
            # A forked child (hivemind's DHT process) inherits this handler; it must die as it would by default,
            # or a terminate() from the parent would be ignored and the parent would wait for it forever.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        stop.set()
        if interrupt is not None and interrupt.is_set():
            raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
