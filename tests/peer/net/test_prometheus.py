"""The Prometheus exposition of a peer's rounds: exact text from round stats, and a real HTTP scrape."""

from __future__ import annotations

import urllib.request

import pytest

from hlbp.peer.common.errors import UserInputError
from hlbp.peer.net.prometheus import MetricsServer, PeerMetrics, render
from hlbp.peer.rounds.loop import RoundStats


def _stats(r: int, accepted: bool) -> RoundStats:
    return RoundStats(round=r, contributed=True, accepted=accepted, members=3, compute_s=2.0, comm_s=0.5,
                      wait_s=0.25, bytes_sent=1000, bytes_received=3000)


def test_render_accumulates_rounds() -> None:
    m = PeerMetrics(peer="12D3KooWabc", run='run"x')
    m.add(_stats(0, True), 8.5)
    m.add(_stats(1, False), 8.25)
    text = render(m)
    labels = '{peer="12D3KooWabc",run="run\\"x"}'  # the library sorts labels by name
    for line in (f"hlbp_rounds_total{labels} 2.0", f"hlbp_rounds_accepted_total{labels} 1.0",
                 f"hlbp_round{labels} 1.0", f"hlbp_bytes_sent_total{labels} 2000.0",
                 f"hlbp_bytes_received_total{labels} 6000.0", f"hlbp_in_sync{labels} 1.0",
                 f"hlbp_val_loss{labels} 8.25",
                 'hlbp_round_seconds_total{part="comm",peer="12D3KooWabc",run="run\\"x"} 1.0',
                 'hlbp_last_round_seconds{part="wait",peer="12D3KooWabc",run="run\\"x"} 0.25',
                 f"hlbp_utilization{labels} {2.0 / 2.75!r}"):
        assert line in text.splitlines(), line
    assert "# TYPE hlbp_rounds_total counter" in text
    assert "hlbp_val_loss" not in render(PeerMetrics())  # no loss before the first round
    assert "hlbp_utilization" not in render(PeerMetrics()) and "hlbp_last_round" not in render(PeerMetrics())


def test_scrape_over_http_and_port_errors() -> None:
    server = MetricsServer("127.0.0.1", 0, PeerMetrics(peer="p", run="r"))
    try:
        server.update(_stats(4, True), 7.0)
        with urllib.request.urlopen(server.url, timeout=10) as resp:
            assert resp.headers["Content-Type"].startswith("text/plain")
            text = resp.read().decode()
        assert 'hlbp_round{peer="p",run="r"} 4.0' in text.splitlines()
        assert "process_resident_memory_bytes" in text  # the library's process metrics come along
        port = int(server.url.rsplit(":", 1)[1].split("/")[0])
        with pytest.raises(UserInputError, match="--metrics-port"):
            MetricsServer("127.0.0.1", port, PeerMetrics())  # taken
    finally:
        server.close()
