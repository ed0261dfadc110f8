"""Following a shard: a bit-identical copy of a shard this peer neither contributes nor vouches for.

Why: in runs whose activation codec rebuilds T_fixed from the synchronized embedding (B, A+drift), every stage
peer needs ``embed.weight`` after every round, and it lives in shard 0. A stage peer of stage s > 0 therefore
*follows* shard 0 (all of it: median-norm clipping weighs a contribution by its norm over the whole shard, and the
round's bounds are relative to the whole shard's norm, so ``embed.weight`` alone could not reproduce the holders'
numbers):

- it decodes the accepted contributions to the followed shard and bounds, aggregates and applies them exactly as a
  holder does (:meth:`hlbp.peer.rounds.sparseloco.RoundRunner._apply`), so its copy is bit-identical to theirs;
  a payload of the followed shard it cannot fetch leaves that shard as it was for the round (its own shard is
  still applied), and a payload that does not decode refuses the round as it does on every holder;
- it never contributes the shard, never publishes a checksum for it and never serves it as a donor;
- after every round, after a state sync and at start it compares the shard's checksum with the majority its
  holders published (:func:`resync_plan`) and, where it differs, fetches the holders' state blob through the
  ordinary state sync (verified against that checksum).

The followed shard's parameters sit in the runner's anchor beside the held ones, so checkpoints keep them.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from hlbp.peer.net.transport import TransportError
from hlbp.peer.rounds.anchor import Anchor
from hlbp.peer.rounds.outer import make_outer
from hlbp.peer.rounds.rules import majority_checksums
from hlbp.peer.rounds.statesync import fetch_state, shard_checksum
from hlbp.protocol.roundwire import ShardChecks

logger = logging.getLogger(__name__)


def follow_anchor(shards: Sequence[Sequence[str]], shapes: Sequence[Mapping[str, tuple[int, ...]]],
                  held: Sequence[int], initial: Mapping[int, Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The anchor entries of the followed shards (float32 CPU copies of ``initial``: shard -> its parameters).

    Raises ValueError when a followed shard is held, is no shard of the partition, or ``initial`` does not hold
    exactly its parameters with their shapes.
    """
    out: dict[str, torch.Tensor] = {}
    for s, params in initial.items():
        if s in held or not 0 <= s < len(shards):
            raise ValueError(f"shard {s} cannot be followed: held {list(held)}, {len(shards)} shards")
        if set(params) != set(shards[s]):
            raise ValueError(f"the initial state of followed shard {s} does not hold exactly its parameters")
        for name, t in params.items():
            if tuple(t.shape) != tuple(shapes[s][name]):
                raise ValueError(f"followed {name} has shape {tuple(t.shape)}, expected {tuple(shapes[s][name])}")
            out[name] = t.detach().to("cpu", torch.float32).clone()
    return out


def resync_plan(checks: Sequence[ShardChecks], round_: int, ours: Mapping[int, str]) -> dict[int, tuple[str, list[str]]]:
    """The followed shards to fetch after ``round_``: for each shard whose checksum ``ours[shard]`` differs from the
    majority its holders published for that round, (the majority's checksum, the holders that published it, sorted).

    A shard no holder published a checksum for is left alone: there is nothing to compare with, and the follower's
    own apply is the best estimate until a holder speaks.
    """
    want = majority_checksums(checks, round_)
    plan = {}
    for s, mine in ours.items():
        if s in want and want[s] != mine:
            donors = sorted({c.peer for c in checks if c.round == round_ and c.checksums.get(s) == want[s]})
            plan[s] = (want[s], donors)
    return plan


class Follower:
    """The followed shards of one round loop: after start, after a state sync and after each verified round the
    loop calls :meth:`check`, which fetches every followed shard that differs from its holders' majority."""

    def __init__(self, follow: Sequence[int], shards: Sequence[Sequence[str]],
                 shapes: Sequence[Mapping[str, tuple[int, ...]]], me: str, transport: Any, cfg: Any,
                 outer_cfg: Any) -> None:
        self.follow = sorted(follow)
        self.shards, self.shapes, self.me = shards, shapes, me
        self.transport, self.cfg, self.outer_cfg = transport, cfg, outer_cfg
        self.fetches = 0  # followed shards fetched from their holders because our copy differed

    def check(self, r: int, anchor: Anchor, outers: dict[int, Any],
              latest_checks: Callable[[], list[ShardChecks]]) -> tuple[bool, int]:
        """After round r: fetch each followed shard whose checksum differs from its holders' majority from those
        holders (verified against it) into ``anchor`` and ``outers``. Returns whether any was fetched (the loop
        then reloads its model: stage peers rebuild their codec's table there) and the bytes received. A fetch
        that fails keeps our copy, logged; the next round's check tries again."""
        if not self.follow:
            return False, 0
        ours = {s: shard_checksum(anchor, self.shards[s], outers[s].state_tensors()) for s in self.follow}
        checks = [c for c in latest_checks() if c.peer != self.me]
        fetched, received = False, 0
        for s, (want, donors) in resync_plan(checks, r, ours).items():
            random.Random(f"{self.me}|{r}|{s}").shuffle(donors)
            try:
                states, n_bytes = fetch_state(self.transport, donors, r, {s: self.shapes[s]},
                                              {d: {s: want} for d in donors}, self.cfg.max_payload_bytes,
                                              self.cfg.fetch_timeout_s, 1)
            except TransportError as exc:
                logger.warning("round %d: followed shard %d differs from its holders' and could not be fetched "
                               "(%s); keeping our copy until the next round", r, s, str(exc)[:2000])
                continue
            received += n_bytes
            anchor.update({n: t.clone() for n, t in states[s].params.items()})
            outers[s] = make_outer(self.outer_cfg)
            outers[s].load_state(states[s].outer)
            fetched = True
            self.fetches += 1
            logger.info("round %d: fetched followed shard %d from %d holders (our copy differed)", r, s, len(donors))
        return fetched, received
