"""Capacity measurement: available memory, training tokens/s of the run's model, bandwidth to a peer.

The role policy (hlbp.peer.node.roles) compares these numbers with thresholds, so they must be cheap (seconds, not
minutes) and in the units the policy uses: memory in GB, throughput in full-model tokens/s, bandwidth in bytes/s.
Sockets and models come in as arguments, so a test can measure a toy model or force the numbers instead.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hlbp.peer.node.roles import Capacity

logger = logging.getLogger(__name__)


def available_memory_gb() -> float:
    """Memory the OS could give this process now, in GB (psutil when installed, else /proc/meminfo)."""
    try:
        import psutil  # optional: the /proc fallback covers Linux, where volunteers and spot instances run

        return psutil.virtual_memory().available / 1e9
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 1e9


@dataclass(frozen=True)
class WarmupSpec:
    """What a throughput warm-up runs: a batch shape and how long it may take."""

    batch_size: int = 4  # sequences per step (the run's micro-batch when measuring its model)
    seq_len: int = 128  # tokens per sequence
    vocab_size: int = 8192  # token ids are drawn below this
    steps: int = 3  # timed steps after the untimed first one
    time_budget_s: float = 20.0  # stop timing after this long even if fewer steps ran
    scale: float = 1.0  # multiply the result: full-model layers / measured layers when a stage stands in


def measure_throughput(model_factory: Callable[[], Any], spec: WarmupSpec, seed: int = 0) -> float:
    """Tokens/s of forward, backward and an AdamW step of ``model_factory()`` on random token ids.

    The model takes token ids [batch, seq] and returns any tensor; its mean square stands in for the loss, which
    costs the same backward pass. The first step is not timed (allocator and kernel warm-up).
    """
    import torch

    torch.manual_seed(seed)
    model = model_factory()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    x = torch.randint(0, spec.vocab_size, (spec.batch_size, spec.seq_len))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).float().square().mean().backward()
        opt.step()

    step()
    start = time.perf_counter()
    done = 0
    while done < spec.steps:
        step()
        done += 1
        if time.perf_counter() - start > spec.time_budget_s:
            break
    elapsed = max(time.perf_counter() - start, 1e-9)
    return done * spec.batch_size * spec.seq_len / elapsed * spec.scale


def measure_bandwidth(transfer: Callable[[int], float], n_bytes: int) -> float:
    """Bytes/s of one timed transfer; ``transfer(n)`` moves n bytes from a peer and returns the seconds taken."""
    seconds = transfer(n_bytes)
    return n_bytes / seconds if seconds > 0 and math.isfinite(seconds) else 0.0


def model_warmup(model: str, overrides: dict[str, Any], stages: tuple[tuple[int, int], ...], batch_size: int,
                 seq_len: int, whole_model_fits: bool) -> tuple[Callable[[], Any], WarmupSpec]:
    """Factory and spec for the run's model: the whole model if it fits in memory, else its first stage.

    A stage's tokens/s is scaled by layers(model) / layers(stage) so both cases report full-model tokens/s.
    """
    from hlbp.peer.model.decoder import Stage, build_model, preset

    config = preset(model, **overrides)
    seq = min(seq_len, config.max_seq_len)
    # The run's own micro-batch: tiny batches are overhead-bound and under-report what training reaches.
    spec = WarmupSpec(batch_size=batch_size, seq_len=seq, vocab_size=config.vocab_size)
    if whole_model_fits:
        return (lambda: build_model(config)), spec
    start, end = stages[0]
    scale = config.n_layers / max(1, end - start)
    return (lambda: Stage(config, start, end)), WarmupSpec(**{**spec.__dict__, "scale": scale})


def measure(memory_gb: float | None, throughput: float | None, bandwidth: float | None,
            throughput_fn: Callable[[float], float], bandwidth_fn: Callable[[], float]) -> Capacity:
    """A Capacity where every number not forced by a flag is measured; measurement failures count as 0.

    ``throughput_fn(memory_gb)`` and ``bandwidth_fn()`` do the measuring, so that a failure (no model, no peer to
    probe) degrades to a slow-looking peer instead of a crash.
    """
    mem = memory_gb if memory_gb is not None else available_memory_gb()
    if throughput is None:
        try:
            throughput = throughput_fn(mem)
        except Exception as exc:  # noqa: BLE001 - any failure of the warm-up means we can't claim speed
            logger.warning("throughput warm-up failed (%s); announcing 0 tokens/s. Pass --throughput to set it.", exc)
            throughput = 0.0
    if bandwidth is None:
        try:
            bandwidth = bandwidth_fn()
        except Exception as exc:  # noqa: BLE001 - a failed probe leaves the role choice to memory and throughput
            logger.warning("bandwidth probe failed (%s); announcing 0 bytes/s. Pass --bandwidth to set it.", exc)
            bandwidth = 0.0
    return Capacity(memory_gb=mem, throughput=throughput, bandwidth=bandwidth)
