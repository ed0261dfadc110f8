"""A Prometheus endpoint for a joined peer: what each finished round cost, scrapeable while the peer runs.

Why: volunteers and spot fleets run ``hlbp join`` unattended for days; the operator's dashboards and alerts
(a replica stuck out of sync, bytes per round creeping up, utilization falling) need numbers they can scrape, not
log lines. ``prometheus-client`` renders and serves them (correct escaping, content negotiation, process
metrics); what is exported is a pure function of the round stats (:func:`render`), tested without a socket.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hlbp.peer.common.errors import UserInputError


@dataclass
class PeerMetrics:
    """Running totals and the last round's values of one peer."""

    peer: str = ""
    run: str = ""
    rounds: int = 0
    accepted: int = 0
    synced: int = 0
    refused: int = 0
    copies: int = 0
    last_round: int = -1
    in_sync: bool = True
    members: int = 0
    val_loss: float | None = None
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: {"compute": 0.0, "comm": 0.0, "wait": 0.0})
    last_seconds: dict[str, float] = field(default_factory=dict)  # the last round's compute, comm and wait

    @property
    def utilization(self) -> float | None:
        """Share of the rounds' time spent computing (compute / (compute + comm + wait)); None before a round."""
        total = sum(self.seconds.values())
        return self.seconds["compute"] / total if total > 0 else None

    def add(self, stats: Any, val_loss: float | None) -> None:
        """Fold one finished round (a :class:`hlbp.peer.rounds.loop.RoundStats`) into the totals."""
        self.rounds += 1
        self.accepted += int(stats.accepted)
        self.synced += int(stats.synced)
        self.refused += int(bool(getattr(stats, "refused", "")))
        self.copies += len(getattr(stats, "copies", ()))
        self.last_round, self.in_sync, self.members = stats.round, stats.in_sync, stats.members
        self.val_loss = val_loss
        self.bytes_sent += stats.bytes_sent
        self.bytes_received += stats.bytes_received
        self.seconds = {"compute": self.seconds["compute"] + stats.compute_s,
                        "comm": self.seconds["comm"] + stats.comm_s, "wait": self.seconds["wait"] + stats.wait_s}
        self.last_seconds = {"compute": stats.compute_s, "comm": stats.comm_s, "wait": stats.wait_s}


class _PeerCollector(Collector):
    """Yields a peer's metrics at every scrape, from the totals :class:`MetricsServer` keeps."""

    def __init__(self, metrics: PeerMetrics, lock: threading.Lock | None = None) -> None:
        self.metrics, self.lock = metrics, lock or threading.Lock()

    def collect(self) -> Iterator[Metric]:
        with self.lock:
            m = PeerMetrics(**{f.name: getattr(self.metrics, f.name) for f in fields(PeerMetrics)})
        names, values = ["run", "peer"], [m.run, m.peer]
        rows: list[tuple[type[Metric], str, str, float]] = [
            (CounterMetricFamily, "hlbp_rounds", "Outer rounds this peer finished.", m.rounds),
            (CounterMetricFamily, "hlbp_rounds_accepted",
             "Rounds whose result includes this peer's contribution.", m.accepted),
            (CounterMetricFamily, "hlbp_state_syncs", "Times this peer reloaded state from others.", m.synced),
            (CounterMetricFamily, "hlbp_rounds_refused",
             "Rounds refused as a whole by the round guard (a contribution or the update broke a bound).", m.refused),
            (CounterMetricFamily, "hlbp_copies_flagged",
             "Contributions flagged as copies (positions overlapping another's, or tensors sent before).", m.copies),
            (GaugeMetricFamily, "hlbp_round", "The last round this peer finished.", m.last_round),
            (GaugeMetricFamily, "hlbp_in_sync", "1 while this peer's parameters are the agreed ones.", int(m.in_sync)),
            (GaugeMetricFamily, "hlbp_round_members", "Contributions in the last round's result.", m.members),
            (CounterMetricFamily, "hlbp_bytes_sent", "Round payload and state bytes this peer served.", m.bytes_sent),
            (CounterMetricFamily, "hlbp_bytes_received", "Round payload and state bytes this peer fetched.",
             m.bytes_received),
        ]
        for family, name, text, value in rows:
            metric = family(name, text, labels=names)
            metric.add_metric(values, value)
            yield metric
        seconds = CounterMetricFamily("hlbp_round_seconds", "Seconds spent per part of the rounds.",
                                      labels=[*names, "part"])
        for part, value in m.seconds.items():
            seconds.add_metric([*values, part], value)
        yield seconds
        if m.last_seconds:
            # the last round alone: how long compute stood still for the network (comm + wait) this round
            last = GaugeMetricFamily("hlbp_last_round_seconds", "Seconds per part of the last finished round.",
                                     labels=[*names, "part"])
            for part, value in m.last_seconds.items():
                last.add_metric([*values, part], value)
            yield last
        if m.utilization is not None:
            util = GaugeMetricFamily("hlbp_utilization",
                                     "Share of round time spent computing, over every finished round.", labels=names)
            util.add_metric(values, m.utilization)
            yield util
        if m.val_loss is not None and math.isfinite(m.val_loss):
            loss = GaugeMetricFamily("hlbp_val_loss", "Validation loss after the last round.", labels=names)
            loss.add_metric(values, m.val_loss)
            yield loss


def render(m: PeerMetrics) -> str:
    """The Prometheus text exposition of a peer's metrics (without the process metrics the server adds)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_PeerCollector(m))
    return generate_latest(registry).decode()


class MetricsServer:
    """Serves a peer's metrics, and its process's (CPU, memory, open files), at ``/metrics`` from a daemon thread.

    Each server has its own registry, so several peers in one process (the network benchmark) do not collide.
    """

    def __init__(self, host: str, port: int, metrics: PeerMetrics) -> None:
        self.metrics = metrics
        self._lock = threading.Lock()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_PeerCollector(metrics, self._lock))
        ProcessCollector(registry=self.registry)
        try:
            self._http, self._thread = start_http_server(port, host, registry=self.registry)
        except OSError as exc:
            raise UserInputError(f"cannot serve metrics on {host}:{port}: {exc.strerror}; pick another "
                                 "--metrics-port (0: any free port)") from None

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
