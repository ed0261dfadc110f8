"""A stage peer's part in the run's SparseLoCo rounds: its own shard, beside the full replicas.

A full replica contributes every shard of the manifest's partition; a stage peer of stage s contributes shard s
(its stage's parameters) and applies, checks and resyncs that shard alone, with the same round records, accepted
sets and checksums as everybody else (hlbp.peer.rounds.sparseloco with ``held=[s]``). What differs is the inner
phase: a stage peer does not step on its own, its swarm does.

- The driver (stage 0) runs the phase itself: up to H steps through its chain, the last one marked ``round_end``
  (hlbp.protocol.stagewire), cut short when the round closes without the swarm; before the next phase it waits
  until the chain's stage peers have loaded the round's result (:meth:`hlbp.peer.swarm.driver.Driver.wait_ready`).
- A stage server's phase ends when its round gate (hlbp.peer.swarm.gate) sees the driver's mark, or when the round
  closes without the swarm (its driver is gone or behind): then the gate closes between two steps. Either way the
  server contributes the steps it applied (a straggler's go back into its error-feedback buffer), loads the
  round's result, and opens the gate.

A stage peer whose swarm lacks a stage, or whose driver has left, takes every round's result with weight 0 and
stays current, so the swarm contributes again as soon as it is whole.

The activation codec's anchor table: in B and A+drift runs T_fixed is a function of the synchronized embedding,
which lives in shard 0. Stage 0 holds it; every other stage peer follows shard 0 (hlbp.peer.rounds.follow: it
applies the accepted contributions to its own copy, bit-identical to the holders', and fetches the holders' state
where it is off). Whenever a stage peer loads a round's result it rebuilds its codec's table from that embedding,
before the round gate opens, so both sides of every boundary use the same table from the next step on; each
round's table digest goes to ``metrics.jsonl`` (event ``table``, with how often the followed copy had to be
fetched because it differed from the holders').
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import torch

from hlbp.peer.model.codec import ActivationCodec
from hlbp.peer.model.decoder import split
from hlbp.peer.model.pipeline import initial_tensors
from hlbp.peer.model.subspace import REBUILT
from hlbp.peer.net.reach import AddressBook
from hlbp.peer.net.transport import P2PBlobTransport
from hlbp.peer.node.replica import contributors_counter, require_state_room, round_settings
from hlbp.peer.rounds.sparseloco import RoundRunner, RoundStats
from hlbp.peer.swarm.gate import RoundGate
from hlbp.peer.swarm.transcript import Notary
from hlbp.peer.swarm.worker import StageWorker
from hlbp.peer.train.turns import Turns

logger = logging.getLogger(__name__)


class PhaseStopped(Exception):
    """The driver reached its ``--max-steps``: the inner phase ends with no round to exchange, and its steps stay
    in the stage's parameters (and stage checkpoint) only.

    A peer that is stopping (SIGTERM, or a move to another stage) does not raise this: its phase returns the
    steps so far, and the round loop, finding no round to send them to, keeps them in the error-feedback buffer that
    the round checkpoint saves, so a restart that resumes its checkpoint sends them in its next contribution."""


class StageTrainer:
    """What the round loop needs of a trainer, for a stage: the stage module and its AdamW state.

    The stage's weights and AdamW moments are saved in the stage checkpoint (hlbp.peer.node.stage.save_stage), so
    the round checkpoint holds only the round state (anchor, error feedback, round number)."""

    def __init__(self, worker: StageWorker) -> None:
        self.worker = worker
        self.model = worker.stage
        self.optimizer = worker.optimizer
        self.tokens = 0
        # a stage's steps run on its server's compute thread, and its round exchange runs between its phases: no
        # forward pass of the exchange waits for a step's turn (hlbp.peer.train.turns)
        self.turns: Turns | None = None

    @torch.no_grad()
    def load_params(self, params: dict[str, torch.Tensor]) -> None:
        """Load the stage's slice of ``params`` (a round's global parameters); variant A's constraint then
        projects later steps' changes from them."""
        for n, p in self.model.named_parameters():
            p.copy_(params[n])
        if self.worker.constraint is not None:
            self.worker.constraint.sync()

    def state_tensors(self) -> tuple[dict[str, Any], dict[str, Any]]:
        return {}, {}

    def load_state(self, tensors: dict[str, Any], header: dict[str, Any]) -> None:
        """Nothing: the stage checkpoint restores the weights and AdamW state."""

    def train_step(self) -> None:
        raise RuntimeError("a stage peer's inner steps come from its swarm's driver")

    def warm_up(self) -> None:
        """Nothing to do here: a stage's passes come from its swarm's driver."""


def serve_phase(runner: RoundRunner, gate: RoundGate, worker: StageWorker, stop: Any,
                dead_step_s: float) -> Callable[[int], tuple[int, int]]:
    """A stage server's inner phase: wait for the driver's end-of-round mark, or for the round to close without
    the swarm (checked every half second); in the second case close the gate between two steps, dropping a step
    that has been under way ``dead_step_s`` seconds (its driver left mid-step)."""

    def phase(r: int) -> tuple[int, int]:
        while not stop.is_set():
            if gate.wait_ended(0.5):
                return gate.take()
            if runner.round_closed(r):
                if not gate.close_between_steps(dead_step_s):
                    worker.reset()
                return gate.take()
        # stopping mid-phase: the steps applied so far end the phase, and with no round left to send them to the
        # round loop keeps them in its error-feedback buffer (saved), as a full replica's stopped phase does
        if not gate.close_between_steps(2.0):
            worker.reset()
        return gate.take()

    return phase


class ChainTaint:
    """A stage's :class:`~hlbp.peer.rounds.sparseloco.Taint`: its round's work is tainted when the round bans a peer
    it received frames from in that round (its transcript says from whom) or a peer of its own swarm (the
    announcements say who: a lie two hops up or down the chain reached it through an honest neighbour, who is not
    banned; only a mate the round newly banned counts), and forgetting clears its AdamW state. ``swarm_mates()``:
    the other peers announcing our swarm (our own ban, for a contribution we did not deliver, taints nothing).
    A phase withdrawn after a resync is listed so in the transcript's index (:meth:`Transcript.withdraw_phase`)."""

    def __init__(self, notary: Notary, worker: StageWorker,
                 swarm_mates: Callable[[], AbstractSet[str]] = frozenset) -> None:
        self.notary, self.worker, self.swarm_mates = notary, worker, swarm_mates
        self.banned_before: frozenset[str] = frozenset()  # the bans in force after the last round asked about

    def tainted(self, r: int, banned: Sequence[str]) -> bool:
        fresh, self.banned_before = frozenset(banned) - self.banned_before, frozenset(banned)
        if set(banned) & {e.key.sender for e in self.notary.transcript.index(r)}:
            return True
        # a mate banned in an earlier round was left behind then: only this round's convictions reach our work
        return bool(fresh and fresh & self.swarm_mates())

    def forget(self) -> None:
        self.worker.forget_moments()

    def phase_started(self, r: int) -> None:
        self.notary.transcript.phase_started(r)

    def withdraw_phase(self, r: int) -> None:
        if self.notary.transcript.withdraw_phase(r):
            logger.warning("round %d: this stage's phase trained from a state a resync replaced; its frames are "
                           "withdrawn from the round's audits", r)


def make_stage_rounds(ctx: Any, worker: StageWorker, config: Any, phase: Callable[[int], tuple[int, int]],
                      metrics: Any, checkpoint_every_s: float, evaluate: Callable[[Any], float | None] | None = None,
                      on_round: Callable[[Any, float | None], None] | None = None,
                      codec: ActivationCodec | None = None, driven: bool = False,
                      notary: Notary | None = None,
                      swarm_mates: Callable[[], AbstractSet[str]] = frozenset,
                      ef_dtype: str = "fp32", state_dir: str = "",
                      guard_loss: Callable[[int, Mapping[str, torch.Tensor]], float | None] | None = None,
                      ) -> tuple[RoundRunner, Any]:
    """The round loop of this stage peer (``ctx``: its join context) and the blob transport it serves its
    payloads and shard state on; the caller closes both. ``driven``: a stage server, whose phase is its driver's
    steps and so is never sat out after a state sync (the driver decides whether the swarm trains that round; a
    server that sat it out while serving the round's steps would count them in its next phase, after the round's
    result had replaced the parameters they trained).

    ``codec``: the stage's activation codec. In a B or A+drift run its table is rebuilt from the synchronized
    embedding after every round, and a stage after the first follows shard 0 for it, starting from the seed's
    initial parameters of that shard (drawn alone, :func:`~hlbp.peer.model.pipeline.initial_tensors`).

    ``ef_dtype``, ``state_dir``: how this peer stores its error feedback, and where it keeps that and the anchor
    ("": in memory); its own choice.

    ``guard_loss(r, params)``: round r's candidate (this stage's ``params``) scored end to end by the swarm's chain
    on the run's guard batch (:mod:`hlbp.peer.swarm.guardslot`) in a round without a full replica, judged as a full
    replica judges its own loss; None from it: the chain did not answer, and the norm bounds alone judge the round.

    ``notary``: what keeps the frames this stage received; a round that bans a peer it received frames from in that
    round, and leaves out this peer's contribution, finds the contribution tainted: it is dropped, and the stage's
    AdamW moments are forgotten (:meth:`StageWorker.forget_moments`); so does a round that bans one of
    ``swarm_mates()`` (the peers announcing this stage's swarm) and leaves out this peer's contribution."""
    peer = ctx.peer
    m = peer.manifest.manifest
    bounds = [tuple(s) for s in m.stages]
    with torch.device("meta"):
        stages = split(config, len(bounds), bounds)
    shards = [[n for n, _ in s.named_parameters()] for s in stages]
    shapes = [{n: tuple(p.shape) for n, p in s.named_parameters()} for s in stages]
    require_state_room(state_dir, sum(math.prod(s) for s in shapes[peer.role.stage].values()), ef_dtype)
    outer, rcfg = round_settings(m, checkpoint_every_s, ef_dtype, state_dir)
    if rcfg.overlap != "none":
        # a stage's next phase starts from the round's result, which its neighbours' frames and the audits assume:
        # stage peers take part in an overlapped run's rounds without starting a phase before the result is in
        logger.info("the run overlaps rounds (%s); stage peers start each phase from the round's result, "
                    "verifying it beside the phase", rcfg.overlap)
        rcfg = dataclasses.replace(rcfg, overlap="none")
    # each round's verification beside the next phase (rounds/beside.py), where the codec's table is fixed: a B or
    # A+drift table follows the embedding, which a resync after the verification would change under the phase
    rcfg = dataclasses.replace(rcfg, verify_beside=getattr(codec, "variant", None) not in REBUILT)
    book = AddressBook(lambda: peer.plane.read_peers(m.run_id))
    transport = P2PBlobTransport(peer.plane.dht, cancel=ctx.stop,
                                 allowed=m.may_contribute if m.allowed_peers else None, addresses=book.maddrs,
                                 dialable_peers=book.dialable)

    expected = contributors_counter(peer.plane, m)
    follow: dict[int, dict[str, torch.Tensor]] = {}
    if peer.role.stage != 0 and getattr(codec, "variant", None) in REBUILT:
        follow = {0: initial_tensors(config, m.seed, shards[0])}  # shard 0's initial values, built alone
    box: list[RoundRunner] = []

    def load_table(anchor: Mapping[str, torch.Tensor]) -> None:
        if codec is not None and "embed.weight" in anchor:
            codec.rebuild_table(anchor["embed.weight"])  # B, A+drift: T_fixed of the loaded embedding

    def reported(stats: RoundStats, val: float | None) -> None:
        if codec is not None and getattr(codec, "variant", None) in REBUILT:
            metrics.write(event="table", round=stats.round, table=codec.table_digest(),
                          follow_fetches=box[0].follower.fetches)
        if on_round is not None:
            on_round(stats, val)

    # the same round loop as a full replica's, holding one shard: the swarm runs its inner phase (``phase``), and
    # each load of the anchor rebuilds the codec's table
    runner = RoundRunner(peer.plane.dht, peer.plane.identity, transport, StageTrainer(worker), outer, shards, rcfg,
                         ctx.stop, checkpoint=ctx.out_dir / "rounds.safetensors", metrics=metrics,
                         expected=expected, on_round=reported, evaluate=evaluate, protect=peer.plane.protect,
                         held=[peer.role.stage], shapes=shapes, train=phase, follow=follow, on_load=load_table,
                         guard_loss=guard_loss,
                         sit_out=not driven, taint=None if notary is None else ChainTaint(notary, worker, swarm_mates))
    box.append(runner)
    return runner, transport

