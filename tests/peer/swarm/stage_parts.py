"""What the in-process stage tests share: a 2-layer tiny model, DHTs on loopback (real p2pd daemons), stages
loaded from the run's initial state, and the dense fp32 codec."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import hivemind
import torch

from hlbp.peer.model.codec import CodecConfig
from hlbp.peer.model.decoder import load_from_full, preset, split
from hlbp.peer.model.pipeline import initial_state
from hlbp.peer.model.subspace import make_codec
from hlbp.peer.swarm.worker import StageWorker
from hlbp.peer.train.trainer import OptimConfig

CONFIG = preset("tiny", vocab_size=300, n_layers=2)
CONFIG3 = preset("tiny", vocab_size=300, n_layers=3)  # for a 3-stage chain, a layer a stage
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


@contextmanager
def started_dhts(n: int) -> Iterator[list[hivemind.DHT]]:
    """``n`` DHTs on 127.0.0.1 that know each other, shut down on exit."""
    first = hivemind.DHT(start=True, host_maddrs=LOOPBACK)
    peers = [str(a) for a in first.get_visible_maddrs()]
    nodes = [first, *(hivemind.DHT(start=True, host_maddrs=LOOPBACK, initial_peers=peers) for _ in range(n - 1))]
    try:
        yield nodes
    finally:
        for d in nodes:
            d.shutdown()


def stage_workers(optim: OptimConfig, *stages_of: int, n_stages: int = 2) -> list[StageWorker]:
    """One worker per entry of ``stages_of`` (the index of its stage of ``n_stages``: 2 of :data:`CONFIG`, or 3 of
    :data:`CONFIG3`), each loaded from the initial state."""
    config = CONFIG if n_stages == 2 else CONFIG3
    full = initial_state(config, 0)
    workers = []
    for i in stages_of:
        stage = split(config, n_stages)[i]
        load_from_full(stage, full)
        workers.append(StageWorker(stage, optim, torch.device("cpu")))
    return workers


def dense_codec() -> Any:
    return make_codec(CodecConfig("dense", wire_dtype="fp32"), CONFIG.d_model, CONFIG.vocab_size, CONFIG.max_seq_len)
