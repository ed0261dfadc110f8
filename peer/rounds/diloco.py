"""DiLoCo rounds through hivemind's stock ``DecentralizedAverager``: the dense baseline, inside a real run.

Why: SparseLoCo's claim is that it needs about 1/100 of the bytes of a dense exchange at little cost in loss. The
honest comparison is the dense exchange the field already uses (hivemind, OpenDiLoCo), run the same way: the same
``hlbp join``, manifest, inner trainer, checkpoints and state sync, with only the outer step swapped. A run whose
manifest says ``outer = "diloco"`` gets this runner.

One round r:

1. Inner phase: H inner steps from the anchor θ(r), cut short when other replicas have already finished round r.
2. Exchange: Δ = θ(r) − θ_local in fp32 goes into the averager's buffers. Matchmaking uses a group key that names
   the round, so replicas of different rounds never average together; it waits at most the round window for the
   live replicas, then hivemind's butterfly all-reduce averages Δ across the group.
3. Apply: DiLoCo's Nesterov outer step on the averaged Δ.
4. Verify: hivemind hands each member ``local + (average − local)``, which differs from the average by an ulp in
   about a third of the values, so dense replicas never agree bit for bit. They publish float64 fingerprints
   beside the checksums and compare those with a tolerance; a replica outside the agreeing majority reloads state.

What the dense baseline cannot do, by construction: DiLoCo has no error-feedback buffer, so a replica left out of a
round (late, or its group failed) drops its local progress and loads the round's result from the others, as
hivemind's own optimizer does; and the stock all-reduce does not let anyone check another peer's contribution
before it is averaged in (non-finite results are refused; garbage within range is not detectable).
"""

from __future__ import annotations

import logging
import math
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import CancelledError
from contextlib import contextmanager
from typing import Any

import torch

from hlbp.peer.common.errors import UserInputError
from hlbp.peer.rounds.agreement import FingerprintAgreement
from hlbp.peer.rounds.loop import ReplicaBase, RoundStats
from hlbp.peer.rounds.outer import Contribution
from hlbp.peer.rounds.rules import adapt_window

logger = logging.getLogger(__name__)

GROUP_BITS = 16  # the round number modulo 2**16 names the matchmaking group key


def round_group_bits(round_: int) -> str:
    """Matchmaking group bits for a round: replicas only average with replicas of the same round."""
    return format(round_ % (1 << GROUP_BITS), f"0{GROUP_BITS}b")


def dense_allreduce_bytes(params: int, members: int) -> int:
    """Bytes each member sends (and receives) in hivemind's butterfly all-reduce of ``params`` fp32 values."""
    return 0 if members < 2 else round(2 * (members - 1) / members * 4 * params)


def parse_gathered(gathered: Any, round_: int) -> dict[str, dict[str, float]]:
    """The group members' gathered metadata, checked: every member must be in ``round_``; raises ValueError."""
    if not isinstance(gathered, dict) or not gathered:
        raise ValueError("the averager returned no group")
    out = {}
    for peer, data in gathered.items():
        if (not isinstance(data, dict) or data.get("round") != round_ or not isinstance(data.get("ready"), float)
                or not math.isfinite(data["ready"])):
            raise ValueError(f"group member {str(peer)[:16]} is not in round {round_} or sent malformed metadata")
        out[str(peer)] = data
    return out


@contextmanager
def sigint_preserved() -> Iterator[None]:
    """Keep our Ctrl-C handler across hivemind's averager start, which sets SIGINT to "ignore" in the *calling*
    process (``DecentralizedAverager.run_in_background``) and never restores it."""
    previous = signal.getsignal(signal.SIGINT)
    try:
        yield
    finally:
        if previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, previous)


def _averager_class() -> type:
    from hivemind.averaging import DecentralizedAverager

    class RoundAverager(DecentralizedAverager):  # type: ignore[misc, valid-type]
        """The stock averager, plus a way to tell its process how many replicas a full group has this round."""

        def set_target_group_size(self, size: int) -> None:
            from hivemind.utils import MPFuture

            future = MPFuture()
            self._outer_pipe.send(("_set_target_group_size", [], {"size": size, "future": future}))
            future.result()

        async def _set_target_group_size(self, size: int, future: Any) -> None:
            self._matchmaking.target_group_size = size
            self._matchmaking.potential_leaders.target_group_size = size
            future.set_result(None)

    return RoundAverager


class DenseRoundRunner(ReplicaBase):
    """A full replica's outer rounds with DiLoCo over hivemind's all-reduce (see the module docstring)."""

    agreement = FingerprintAgreement()  # an all-reduce sums in a different order on each peer

    def __init__(self, *args: Any, matchmaking_s: float = 2.0, request_timeout_s: float = 1.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.outer_cfg.kind != "diloco":
            raise UserInputError("the dense round runner needs the diloco outer optimizer")
        if self.cfg.overlap != "none":
            raise UserInputError("overlapped rounds are built for sparseloco runs only; the dense diloco baseline "
                                 "runs with overlap = \"none\"")
        self.names = [n for s in self.shards for n in s]
        self.n_params = sum(math.prod(self.shapes[i][n]) for i, s in enumerate(self.shards) for n in s)
        self.buffers = [torch.zeros(self.shapes[i][n]) for i, s in enumerate(self.shards) for n in s]
        chunk_timeout = max(5.0, self.cfg.fetch_timeout_s / 6)
        with sigint_preserved():
            self.averager = self._start_averager(matchmaking_s, request_timeout_s, chunk_timeout)
        self._last_group: list[str] = []

    def _start_averager(self, matchmaking_s: float, request_timeout_s: float, chunk_timeout: float) -> Any:
        return _averager_class()(
            self.buffers, self.dht, start=True, prefix=f"hlbp_{self.cfg.run_id}_diloco",
            target_group_size=None, min_group_size=max(2, self.cfg.min_contributors), min_matchmaking_time=matchmaking_s,
            request_timeout=request_timeout_s, allreduce_timeout=2 * self.cfg.fetch_timeout_s,
            next_chunk_timeout=chunk_timeout, allow_state_sharing=False,  # state sync is ours, verified
        )

    def close(self) -> None:
        self.averager.shutdown()

    def round_closed(self, r: int, wait: bool = True) -> bool:
        """Other replicas already published their state after round r: we are too late for it. Always looked up,
        whatever ``wait`` says: the dense baseline keeps its checks as they were."""
        return any(c.round >= r for c in self.records.latest_checks() if c.peer != self.me)

    # -- one round -----------------------------------------------------------------------------------------

    def run_round(self) -> RoundStats:
        r = self.state.round
        stats, steps, tokens, served_before = self.begin_round(r)
        t1 = time.perf_counter()
        averaged, members, waited = None, 0, 0.0
        if steps and self.state.in_sync and not self.stop.is_set():
            stats.contributed = True
            averaged, members, waited = self.exchange(r, tokens)
        stats.wait_s = waited
        stats.members = members
        if averaged is not None:
            stats.accepted = True
            stats.bytes_analytic = True
            sent = dense_allreduce_bytes(self.n_params, members)
            for s, names in enumerate(self.shards):
                c = Contribution("group", tokens, {n: averaged[n] for n in names})
                self.state.anchor.update(self.state.outers[s].apply({n: self.state.anchor[n] for n in names}, [c]))
        else:
            sent = 0
            # left out (late, alone, or the group failed): DiLoCo keeps no error feedback, so this replica's
            # progress is dropped and it takes the round's result from the others, if there is one
            self._await_result(r)
        self.load_anchor_into_model()
        mine = self.syncer.checks(self.state, r)
        stats.checksums = mine.checksums
        if averaged is not None:
            self.syncer.publish(self.state, mine)
            self.state.in_sync = self.syncer.verify(r, dict.fromkeys(self._last_group), mine)
        elif any(c.round >= r for c in self.records.latest_checks() if c.peer != self.me):
            self.state.in_sync = False  # the others moved on without us: reload their state
        if not self.stop.is_set() or averaged is not None:
            self.state.round = r + 1
        if not self.state.in_sync:
            stats.synced = self.sync()
            if stats.synced:  # report the state we now hold, not the one we discarded
                stats.state_round = self.state.round - 1
                mine = self.syncer.checks(self.state, stats.state_round)
                stats.checksums = mine.checksums
        stats.in_sync = self.state.in_sync
        stats.comm_s = time.perf_counter() - t1 - stats.wait_s
        stats.bytes_sent = self.bytes_served() - served_before + sent
        stats.bytes_received = self._bytes_in + sent
        self.save_if_due()
        if averaged is None and self.stop.is_set():
            return stats
        return self.report(stats, mine, steps)

    def exchange(self, r: int, tokens: int) -> tuple[dict[str, torch.Tensor] | None, int, float]:
        """Average Δ with this round's group; (averaged Δ by name or None, members, seconds spent matchmaking)."""
        from hivemind.averaging.control import AveragingStage
        from hivemind.utils import get_dht_time

        expected = self.expected().count if self.expected else self.last_members
        delta = {n: self.state.anchor[n] - self._param(n).detach().float().cpu() for n in self.names}
        if expected == 1 and self.cfg.min_contributors <= 1:  # the only live replica the control plane knows of
            self._last_group = [self.me]
            return delta, 1, 0.0  # the only replica of the run: its own Δ is the round's average
        with torch.no_grad(), self.averager.get_tensors() as bufs:
            for buf, name in zip(bufs, self.names):
                buf.copy_(delta[name])
        self.averager.set_group_bits(round_group_bits(r))
        self.averager.set_target_group_size(max(2, expected))
        ready = get_dht_time()
        window = max(self.window, 1.0)
        self._last_group = []
        t0 = time.perf_counter()
        control = self.averager.step(
            gather={"round": r, "ready": float(ready), "tokens": int(tokens)}, weight=1.0,
            scheduled_time=ready + window, timeout=window + 2 * self.cfg.fetch_timeout_s, allow_retries=False,
            wait=False,
        )
        matched = None
        last_check = 0.0
        while not control.done():
            now = time.perf_counter()
            if control.stage in (AveragingStage.AWAITING_TRIGGER, AveragingStage.RUNNING_ALLREDUCE):
                matched = matched or now  # in a group: the all-reduce is under way, and others depend on us
            elif self.stop.is_set():
                control.cancel()
                break
            elif now - last_check > 0.5:
                last_check = now
                if self.round_closed(r):
                    control.cancel()  # still without a group when the others finished: out of this round
                    break
            time.sleep(0.02)  # polling a future that lives in the averager's process
        waited = (matched or time.perf_counter()) - t0
        try:
            group = parse_gathered(control.result(timeout=0), r)
        except (Exception, CancelledError) as exc:  # noqa: BLE001 - failed, cancelled or mixed: out of the round
            logger.warning("round %d: dense all-reduce did not include this replica (%s); loading the round's "
                           "result from the others", r, str(exc)[:160] or type(exc).__name__)
            return None, 0, waited
        with self.averager.get_tensors() as bufs:
            averaged = {name: buf.clone() for name, buf in zip(self.names, bufs)}
        if not all(bool(torch.isfinite(t).all()) for t in averaged.values()):
            logger.warning("round %d: the all-reduce returned non-finite values; refusing them", r)
            return None, 0, waited
        self._last_group = list(group)
        offsets = sorted(d["ready"] for d in group.values())
        self.window = adapt_window([t - offsets[0] for t in offsets], self.cfg.min_deadline_s,
                                   self.cfg.max_deadline_s, self.window)
        self.last_members = len(group)
        return averaged, len(group), waited

    def _await_result(self, r: int) -> None:
        """A replica left out of round r waits (bounded) for the others to publish its result, then syncs."""
        deadline = time.monotonic() + self.cfg.checks_wait_s + 2 * self.cfg.fetch_timeout_s
        while time.monotonic() < deadline and not self.stop.is_set():
            if self.round_closed(r):
                return
            self.stop.wait(self.cfg.poll_s * 5)
