"""Role choice: a pure function from this peer's capacity and what the swarm lacks to a role.

A strong peer holds a full replica. A weak one becomes stage s of pipeline swarm m, where the policy

1. completes the most complete unfinished swarm first (its missing stage with the lowest index),
2. then strengthens the stage with the least summed throughput among stages that still have room,
3. and only then opens a new swarm at stage 0.

After joining, a stage peer that does no work may move (:func:`propose_move`, :class:`MoveConfirmer`): a spare of
a stage (another peer holds it in its swarm) or a member of an incomplete swarm moves to the one stage that an
incomplete swarm lacks, so that swarm starts contributing. A member of an incomplete swarm moves only into a swarm
with a lower number, so two half swarms merge instead of swapping. A peer that trains never moves, and a move
happens only when the same proposal was made twice at least one period apart (a record of a dead peer lapses within
one period, so a gap seen twice is real), with the reason in the log.

Everything the rule needs comes in as arguments (no network, no clock), so each case is a unit test, and every
peer of a run decides the same way from the same announcements. The thresholds that separate strong from weak come
from the run manifest (throughput) and what training the model's parameters takes (memory, :func:`training_memory_gb`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

MAX_SWARMS = 1 << 16  # swarm ids a peer may ask for with --swarm
RUNTIME_BASE_GB = 0.5  # torch, hivemind's p2pd and DHT process before any model
STAGE_EXTRA_GB = 0.25  # a stage peer's codec, frame transcript and micro-batches on the wire (about 190 MiB on small)
HEAP_SLACK_BYTES = 3.0  # per parameter: the round's transients and the heap two threads leave in pieces, measured
# with hlbp bench memory (a full replica of small and 125m peaked 3.8-4.9 B/param above its state, of which its
# activations at 4x64 tokens were 1.6-2.9)
STEP_STATE_BYTES = {"fp32": 16.0, "bf16": 16.0, "bf16-v": 14.0, "bf16-all": 12.0}
"""Per parameter while a step runs, by ``--state-dtype``: the parameters (4), their gradients (4) and AdamW's moments
(8, or 6 and 4 with one or both in bf16)."""
ROUND_STATE_BYTES = {"fp32": 8.0, "bf16": 6.0, "bf16-v": 6.0, "bf16-all": 6.0}
"""Per parameter with ``--state-in-memory``: the anchor (4) and the error feedback (4 in fp32, else 2); on disk, 0."""


@dataclass(frozen=True)
class StateLayout:
    """How this peer keeps its training state: ``hlbp join --state-dtype``, ``--state-on-disk``, ``--recompute``."""

    state_dtype: str = "bf16"
    on_disk: bool = True
    recompute: bool = False

    def bytes_per_param(self) -> float:
        """What each trained parameter costs at a step's peak, activations apart (docs/design.md, "Memory per
        parameter")."""
        return (STEP_STATE_BYTES[self.state_dtype] + (0.0 if self.on_disk else ROUND_STATE_BYTES[self.state_dtype])
                + HEAP_SLACK_BYTES)


def activation_bytes(d_model: int, d_ff: int, layers: int, vocab: int, tokens: int, recompute: bool,
                     head: bool) -> float:
    """Bytes a forward of ``tokens`` tokens through ``layers`` blocks (and the head and loss when ``head``) holds
    for its backward: per token and block 10 ``d_model`` + 2 ``d_ff`` float32 values (the block's input and its
    residual, the two norms' outputs, attention's q, k, v and output and the output's copy, SwiGLU's gate and up
    projection: :mod:`hlbp.peer.model.ops`; the fused attention keeps no score matrix), only the block's input
    under recompute; at the head, 4 ``d_model`` per token (its norm and the gradient of its input) and either the
    log-probabilities (tokens x vocab) or the head's gradient (vocab x ``d_model``), whichever the loss holds
    (:func:`~hlbp.peer.model.ops.fused_head`: the smaller, give or take the tokens' gradient). Counted
    exactly on tiny, small and 125m (:func:`hlbp.peer.bench.stepcost.held_for_backward`), this is 0-20 % above
    (``tests/peer/node/test_roles.py``)."""
    # imported here: the flags' parsing imports this module, and importing torch takes seconds
    from hlbp.peer.model.ops import fused_head

    per_token = layers * (d_model if recompute else 10 * d_model + 2 * d_ff)
    held = 4.0 * tokens * per_token
    if head:
        held += 4.0 * (4 * d_model * tokens + (vocab * d_model if fused_head(tokens, vocab, d_model) else
                                                 vocab * tokens))
    return held


def training_memory_gb(n_params: int, activations: float, layout: StateLayout, extra_gb: float = 0.0) -> float:
    """Memory, in GB, that training ``n_params`` parameters takes with ``activations`` bytes held for a step's
    backward, kept as ``layout`` says, plus ``extra_gb`` and the runtime."""
    return (n_params * layout.bytes_per_param() + activations) / 1e9 + RUNTIME_BASE_GB + extra_gb


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



@dataclass(frozen=True)
class Role:
    """The decision, with the reason shown to the user."""

    kind: str  # replica or stage
    swarm: int | None = None  # set for stage peers
    stage: int | None = None  # set for stage peers
    reason: str = ""  # one sentence: why this role
    fits: bool = True  # False when the machine has less memory than the role needs (only a flag can force that)


def recompute_hint(memory_gb: float, role: Role, needs: Thresholds, recomputed: Thresholds | None,
                   forced: bool = False) -> str | None:
    """A line for a peer that took a stage only for want of memory, when recomputing its blocks in the backward
    would let it hold a full replica (``recomputed``: the thresholds with ``--recompute``; None when it is on;
    ``forced``: the operator chose the role with a flag, so there is nothing to suggest)."""
    if forced or role.kind != "stage" or recomputed is None or memory_gb >= needs.replica_memory_gb \
            or memory_gb < recomputed.replica_memory_gb:
        return None
    return (f"with --recompute a full replica needs {recomputed.replica_memory_gb:.1f} GB, which this machine has "
            f"({memory_gb:.1f} GB), for 14-19 % more compute a step")


def choose_role(
    me: Capacity,
    peers: list[PeerView],
    n_stages: int,
    thresholds: Thresholds,
    *,
    force_role: str | None = None,
    force_stage: int | None = None,
    force_swarm: int | None = None,
) -> Role:
    """Pick this peer's role; ``force_role`` ("replica" or "stage"), ``force_stage`` and ``force_swarm`` are the
    user's overrides (a forced swarm without a stage gets that swarm's first missing stage, or its weakest).

    Raises ValueError for an override that does not fit the run (unknown role, stage or swarm out of range, or a
    stage or swarm together with ``force_role="replica"``); the caller turns it into a user error.
    """
    if n_stages < 1:
        raise ValueError("a run has at least one stage")
    if force_role not in (None, "replica", "stage"):
        raise ValueError(f"role must be replica or stage, got {force_role!r}")
    if force_stage is not None and not 0 <= force_stage < n_stages:
        raise ValueError(f"stage must be in 0..{n_stages - 1} for this run, got {force_stage}")
    if force_swarm is not None and not 0 <= force_swarm < MAX_SWARMS:
        raise ValueError(f"swarm must be in 0..{MAX_SWARMS - 1}, got {force_swarm}")
    if force_role == "replica" and (force_stage is not None or force_swarm is not None):
        raise ValueError("a full replica holds every stage; drop --stage/--swarm or use --role stage")
    if force_swarm is not None:
        swarm, stage, why = _place_in_swarm(peers, n_stages, force_swarm, force_stage)
        return Role("stage", swarm=swarm, stage=stage, reason=f"forced by --swarm; {why}",
                    fits=me.memory_gb >= thresholds.stage_memory_gb)

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


def _stage_map(peers: list[PeerView], n_stages: int) -> dict[int, dict[int, list[PeerView]]]:
    """swarm -> stage -> the stage peers holding it (replicas, bootstraps and out-of-range stages left out)."""
    swarms: dict[int, dict[int, list[PeerView]]] = defaultdict(lambda: defaultdict(list))
    for peer in peers:
        if peer.role == "stage" and peer.swarm is not None and peer.stage is not None and 0 <= peer.stage < n_stages:
            swarms[peer.swarm][peer.stage].append(peer)
    return swarms


def _place_in_swarm(peers: list[PeerView], n_stages: int, swarm: int, force_stage: int | None) -> tuple[int, int, str]:
    """(swarm, stage, reason) inside a swarm the user chose: the given stage, else its first missing stage, else
    its stage with the least summed throughput."""
    stages = _stage_map(peers, n_stages).get(swarm, {})
    if force_stage is not None:
        return swarm, force_stage, f"stage {force_stage} of swarm {swarm} as asked"
    missing = [s for s in range(n_stages) if not stages.get(s)]
    if missing:
        return swarm, missing[0], f"stage {missing[0]} is missing from swarm {swarm}"
    total, s = min((sum(p.throughput for p in stages[s]), s) for s in range(n_stages))
    return swarm, s, f"stage {s} of swarm {swarm} has the least throughput ({total:,.0f} tok/s)"


def _place_stage(peers: list[PeerView], n_stages: int, max_per_stage: int,
                 force_stage: int | None) -> tuple[int, int, str]:
    """(swarm, stage, reason) for a new stage peer, following the three steps of the module docstring."""
    swarms = {m: {s: [p.throughput for p in held] for s, held in stages.items()}
              for m, stages in _stage_map(peers, n_stages).items()}
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


def propose_move(me: PeerView, peers: list[PeerView], n_stages: int, idle: bool) -> Role | None:
    """Where stage peer ``me`` should move, or None (see the module docstring). ``peers``: the other online peers;
    ``idle``: ``me`` served no step since the last proposal (a peer that trains never moves)."""
    if not idle or me.role != "stage" or me.swarm is None or me.stage is None:
        return None
    swarms = _stage_map([p for p in peers if p.peer_id != me.peer_id] + [me], n_stages)
    mine = swarms.get(me.swarm, {})
    spare = any(p.peer_id != me.peer_id for p in mine.get(me.stage, []))
    incomplete = any(not mine.get(s) for s in range(n_stages))
    if not spare and not incomplete:
        return None  # the swarm needs this peer
    for m in sorted(swarms):
        if m == me.swarm or (not spare and m > me.swarm):
            continue
        missing = [s for s in range(n_stages) if not swarms[m].get(s)]
        if len(missing) == 1:
            why = (f"spare of stage {me.stage} in swarm {me.swarm}" if spare
                   else f"swarm {me.swarm} lacks a stage") + f"; swarm {m} lacks only stage {missing[0]}"
            return Role("stage", swarm=m, stage=missing[0], reason=why)
    return None


class MoveConfirmer:
    """A move is made only when the same proposal comes twice at least ``period_s`` apart (pure: the caller
    passes the clock)."""

    def __init__(self, period_s: float) -> None:
        self.period_s = period_s
        self._first: tuple[tuple[int | None, int | None], float] | None = None

    def observe(self, proposal: Role | None, now: float) -> Role | None:
        """The confirmed move, or None. A different proposal, or none, starts over."""
        if proposal is None:
            self._first = None
            return None
        key = (proposal.swarm, proposal.stage)
        if self._first is None or self._first[0] != key:
            self._first = (key, now)
            return None
        seen = now - self._first[1]
        if seen < self.period_s:
            return None
        return Role("stage", swarm=proposal.swarm, stage=proposal.stage,
                    reason=f"{proposal.reason} (seen for {seen:.0f} s)")
