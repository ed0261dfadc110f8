"""A Prometheus endpoint for a joined peer: what each finished round cost, scrapeable while the peer runs.

Why: volunteers and spot fleets run ``hlbp join`` unattended for days; the operator's dashboards and alerts
(a replica stuck out of sync, bytes per round creeping up, utilization falling) need numbers they can scrape, not
log lines. The exposition format is plain text, so the standard library's HTTP server serves it; the values are
a pure function of the round stats (:func:`render`), tested without a socket.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from hlbp.peer.common.errors import UserInputError

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass
class PeerMetrics:
    """Running totals and the last round's values of one peer."""

    peer: str = ""
    run: str = ""
    rounds: int = 0
    accepted: int = 0
    synced: int = 0
    last_round: int = -1
    in_sync: bool = True
    members: int = 0
    val_loss: float | None = None
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: {"compute": 0.0, "comm": 0.0, "wait": 0.0})

    def add(self, stats: Any, val_loss: float | None) -> None:
        """Fold one finished round (a :class:`hlbp.peer.rounds.loop.RoundStats`) into the totals."""
        self.rounds += 1
        self.accepted += int(stats.accepted)
        self.synced += int(stats.synced)
        self.last_round, self.in_sync, self.members = stats.round, stats.in_sync, stats.members
        self.val_loss = val_loss
        self.bytes_sent += stats.bytes_sent
        self.bytes_received += stats.bytes_received
        self.seconds = {"compute": self.seconds["compute"] + stats.compute_s,
                        "comm": self.seconds["comm"] + stats.comm_s, "wait": self.seconds["wait"] + stats.wait_s}


def _labels(m: PeerMetrics) -> str:
    esc = [v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for v in (m.run, m.peer)]
    return f'{{run="{esc[0]}",peer="{esc[1]}"}}'


def render(m: PeerMetrics) -> str:
    """The Prometheus text exposition of a peer's metrics."""
    lab = _labels(m)
    rows = [
        ("hlbp_rounds_total", "counter", "Outer rounds this peer finished.", m.rounds),
        ("hlbp_rounds_accepted_total", "counter", "Rounds whose result includes this peer's contribution.",
         m.accepted),
        ("hlbp_state_syncs_total", "counter", "Times this peer reloaded state from others.", m.synced),
        ("hlbp_round", "gauge", "The last round this peer finished.", m.last_round),
        ("hlbp_in_sync", "gauge", "1 while this peer's parameters are the agreed ones.", int(m.in_sync)),
        ("hlbp_round_members", "gauge", "Contributions in the last round's result.", m.members),
        ("hlbp_bytes_sent_total", "counter", "Round payload and state bytes this peer served.", m.bytes_sent),
        ("hlbp_bytes_received_total", "counter", "Round payload and state bytes this peer fetched.",
         m.bytes_received),
    ]
    out = []
    for name, kind, text, value in rows:
        out += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", f"{name}{lab} {value}"]
    out += ["# HELP hlbp_round_seconds_total Seconds spent per part of the rounds.",
            "# TYPE hlbp_round_seconds_total counter"]
    for part, value in m.seconds.items():
        out.append(f'hlbp_round_seconds_total{lab[:-1]},part="{part}"}} {value:.6f}')
    if m.val_loss is not None and math.isfinite(m.val_loss):
        out += ["# HELP hlbp_val_loss Validation loss after the last round.", "# TYPE hlbp_val_loss gauge",
                f"hlbp_val_loss{lab} {m.val_loss:.6f}"]
    return "\n".join(out) + "\n"


class MetricsServer:
    """Serves :func:`render` of the current metrics at ``/metrics`` from a daemon thread."""

    def __init__(self, host: str, port: int, metrics: PeerMetrics) -> None:
        self.metrics = metrics
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404, "only /metrics is served")
                    return
                with server._lock:
                    body = render(server.metrics).encode()
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_args: Any) -> None:  # scrapes every few seconds must not flood the log
                pass

        try:
            self._http = ThreadingHTTPServer((host, port), Handler)
        except OSError as exc:
            raise UserInputError(f"cannot serve metrics on {host}:{port}: {exc.strerror}; pick another "
                                 "--metrics-port (0: any free port)") from None
        self._http.daemon_threads = True
        threading.Thread(target=self._http.serve_forever, name="metrics-http", daemon=True).start()

    @property
    def url(self) -> str:
        host, port = self._http.server_address[:2]
        return f"http://{host}:{port}/metrics"

    def update(self, stats: Any, val_loss: float | None) -> None:
        with self._lock:
            self.metrics.add(stats, val_loss)

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
