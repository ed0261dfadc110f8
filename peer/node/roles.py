"""Role choice: a pure function from this peer's capacity and what the swarm lacks to a role.

A strong peer holds a full replica. A weak one becomes stage s of pipeline swarm m, where the policy

1. completes the most complete unfinished swarm first (its missing stage with the lowest index),
2. then strengthens the stage with the least summed throughput among stages that still have room,
3. and only then opens a new swarm at stage 0.

Everything the rule needs comes in as arguments (no network, no clock), so each case is a unit test, and every
peer of a run decides the same way from the same announcements. The thresholds that separate strong from weak come
from the run manifest (throughput) and the model size (memory), see :meth:`Thresholds.for_model`.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

REPLICA_BYTES_PER_PARAM = 24  # fp32 params, grads, two AdamW moments, outer copy of θ(t), error-feedback buffer
ACTIVATION_OVERHEAD = 1.25  # activations, allocator slack and temporary buffers on top of the states above
RUNTIME_BASE_GB = 0.5  # torch, hivemind's p2pd and DHT process before any model


@dataclass(frozen=True)
class Capacity:
    """What this machine can give, measured by hlbp.peer.node.capacity or forced by flags."""

    memory_gb: float  # memory available for training
    throughput: float  # training speed in full-model tokens/s (scaled from a stage when the model does not fit)
    bandwidth: float  # download bandwidth from a peer over the data plane, bytes/s


@dataclass(frozen=True)
class PeerView:
    """The part of another peer's announcement the policy looks at; offline and expired peers are left out."""

    peer_id: str
    role: str  # replica, stage or bootstrap
    swarm: int | None = None
    stage: int | None = None
    throughput: float = 0.0  # full-model tokens/s


@dataclass(frozen=True)
class Thresholds:
    """Where strong ends and weak begins, for one model and partition."""

    replica_memory_gb: float  # memory a full replica needs
    stage_memory_gb: float  # memory the largest stage needs
    replica_min_throughput: float = 0.0  # full-model tokens/s a replica needs (from the manifest's placement)
    max_peers_per_stage: int = 1  # stage peers per stage of a swarm before a new swarm opens

    @classmethod
    def for_model(cls, n_params: int, largest_stage_params: int, replica_min_throughput: float = 0.0,
                  max_peers_per_stage: int = 1) -> Thresholds:
        """Memory thresholds estimated from parameter counts: states per parameter, activations, runtime."""
        return cls(
            replica_memory_gb=estimate_memory_gb(n_params),
            stage_memory_gb=estimate_memory_gb(largest_stage_params),
            replica_min_throughput=replica_min_throughput,
            max_peers_per_stage=max_peers_per_stage,
        )


def estimate_memory_gb(n_params: int) -> float:
    """Memory to train ``n_params`` parameters with AdamW plus SparseLoCo's outer state, in GB."""
    return n_params * REPLICA_BYTES_PER_PARAM * ACTIVATION_OVERHEAD / 1e9 + RUNTIME_BASE_GB


@dataclass(frozen=True)
class Role:
    """The decision, with the reason shown to the user."""

    kind: str  # replica or stage
    swarm: int | None = None  # set for stage peers
    stage: int | None = None  # set for stage peers
    reason: str = ""  # one sentence: why this role
    fits: bool = True  # False when the machine has less memory than the role needs (only a flag can force that)


def choose_role(
    me: Capacity,
    peers: list[PeerView],
    n_stages: int,
    thresholds: Thresholds,
    *,
    force_role: str | None = None,
    force_stage: int | None = None,
) -> Role:
    """Pick this peer's role; ``force_role`` ("replica" or "stage") and ``force_stage`` are the user's overrides.

    Raises ValueError for an override that does not fit the run (unknown role, stage out of range, or a stage
    together with ``force_role="replica"``); the caller turns it into a user error.
    """
    if n_stages < 1:
        raise ValueError("a run has at least one stage")
    if force_role not in (None, "replica", "stage"):
        raise ValueError(f"role must be replica or stage, got {force_role!r}")
    if force_stage is not None and not 0 <= force_stage < n_stages:
        raise ValueError(f"stage must be in 0..{n_stages - 1} for this run, got {force_stage}")
    if force_role == "replica" and force_stage is not None:
        raise ValueError("a full replica holds every stage; drop --stage or use --role stage")

    fits_replica = me.memory_gb >= thresholds.replica_memory_gb
    fast_enough = me.throughput >= thresholds.replica_min_throughput
    if force_role == "replica":
        return Role("replica", reason="forced by --role replica", fits=fits_replica)
    if force_role is None and force_stage is None and fits_replica and fast_enough:
        return Role("replica", reason=(
            f"{me.memory_gb:.1f} GB >= {thresholds.replica_memory_gb:.1f} GB and {me.throughput:,.0f} tok/s >= "
            f"{thresholds.replica_min_throughput:,.0f} tok/s: strong enough for a full replica"))

    swarm, stage, why = _place_stage(peers, n_stages, thresholds.max_peers_per_stage, force_stage)
    if force_role is not None or force_stage is not None:
        why = f"forced by {'--stage' if force_stage is not None else '--role stage'}; {why}"
    elif not fits_replica:
        why = f"{me.memory_gb:.1f} GB < {thresholds.replica_memory_gb:.1f} GB for a full replica; {why}"
    else:
        why = (f"{me.throughput:,.0f} tok/s < {thresholds.replica_min_throughput:,.0f} tok/s for a full replica; "
               f"{why}")
    return Role("stage", swarm=swarm, stage=stage, reason=why, fits=me.memory_gb >= thresholds.stage_memory_gb)


def _place_stage(peers: list[PeerView], n_stages: int, max_per_stage: int,
                 force_stage: int | None) -> tuple[int, int, str]:
    """(swarm, stage, reason) for a new stage peer, following the three steps of the module docstring."""
    # swarm -> stage -> throughputs of the peers holding it
    swarms: dict[int, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for peer in peers:
        if peer.role == "stage" and peer.swarm is not None and peer.stage is not None and peer.stage < n_stages:
            swarms[peer.swarm][peer.stage].append(peer.throughput)
    wanted = range(n_stages) if force_stage is None else (force_stage,)

    incomplete = []
    for m, stages in swarms.items():
        missing = [s for s in range(n_stages) if not stages.get(s)]
        gaps = [s for s in missing if s in wanted]
        if gaps:
            incomplete.append((len(missing), m, gaps[0]))
    if incomplete:
        n_missing, m, s = min(incomplete)
        return m, s, f"stage {s} is missing from swarm {m} ({n_missing} of {n_stages} stages missing)"

    slots = [
        (sum(stages.get(s, [])), m, s)
        for m, stages in swarms.items()
        for s in wanted
        if len(stages.get(s, [])) < max_per_stage
    ]
    if slots:
        total, m, s = min(slots)
        return m, s, f"stage {s} of swarm {m} has the least throughput ({total:,.0f} tok/s)"

    m = next(i for i in range(len(swarms) + 1) if i not in swarms)
    s = 0 if force_stage is None else force_stage
    reason = "every swarm is full" if swarms else "no pipeline swarm exists yet"
    return m, s, f"{reason}: opening swarm {m} at stage {s}"
