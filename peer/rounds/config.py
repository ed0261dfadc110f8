"""A replica's round settings (from the run manifest) and what one round cost it: the plain data the round loops,
the node and the simulate report share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hlbp.peer.rounds.guard import GuardConfig


@dataclass
class RoundConfig:
    """Round protocol settings; the run manifest supplies the first five."""

    run_id: str
    inner_steps: int  # H
    deadline_s: float = 30.0  # first collection window after the first contribution arrives
    min_deadline_s: float = 2.0  # bounds of the adapted window
    max_deadline_s: float = 600.0
    takeover_s: float = 3.0  # a k-th ranked coordinator waits k times this past the window before it takes over
    # how long a peer waits for round records it has reason to expect over the network: a holder's answer once a
    # lead asked, the notices of a set's members, the notices a set's coordinator named. A push's round trip with
    # room for a loaded peer; not takeover_s, which in a run with stage peers also covers a coordinator's audits
    # (18 s): as that, a holder killed mid-run held each round it sat in for 18 s past its leads' turn
    grace_s: float = 3.0
    poll_s: float = 0.1  # DHT polling interval while waiting
    fetch_timeout_s: float = 30.0  # per payload from its sender; other holders get a fifth of it
    checks_wait_s: float = 10.0  # how long to wait for the other members' checksums
    record_ttl_s: float = 900.0  # lifetime of round records in the DHT
    max_payload_bytes: int = 1 << 31  # largest contribution or state blob fetched
    fetch_workers: int = 4  # parallel payload fetches
    # while a round has at most this many contributions, every member fetches and checks each one as its notice
    # arrives, before the accepted set: applying then waits on no transfer, but each sender uploads its payload
    # to every member; in larger rounds payloads are fetched after the accepted set, from holders (gossip)
    prefetch_up_to: int = 16
    min_contributors: int = 1  # a round applies nothing unless at least this many contributions were accepted
    gather: int = 0  # F: at most this many contributions per shard a round accepts (0: all; rounds/gather.py)
    reserves: int = 0  # R: further contributions the coordinator checks to replace selected ones that fail
    unselected: str = "drop"  # a contribution the gather set had no room for: "drop" what it sent, or "keep" it
    committee: int = 0  # W: seats that take the notices and pass the round's records on (0: all-to-all; committee.py)
    checkpoint_every_s: float = 300.0  # save at most this often during the run (0: every round); always on exit
    dht_timeout_s: float = 60.0  # a DHT lookup or store that takes longer is given up (a lookup reads as empty)
    guard: GuardConfig = field(default_factory=GuardConfig)  # bounds on a contribution and on a round's update
    allowed_peers: frozenset[str] = frozenset()  # closed run: only these peers' round records count (empty: all)
    overlap: str = "none"  # a round's exchange runs during the next inner phase: none, naive or eager (overlap.py)
    # a stage peer's own choice, not the run's: each round's verification runs beside its next phase
    # (rounds/beside.py), for stage peers that follow no shard
    verify_beside: bool = False
    dialable: bool = True  # others can dial this peer; False (behind NAT): its notices say so, and it coordinates last
    # where this peer keeps the round state it reads a few times a round, not every step (the anchor; the error
    # feedback is OuterConfig.ef_dir): "" in memory, else in files under this directory (hlbp.peer.common.spill)
    state_dir: str = ""

    def longest_open_s(self) -> float:
        """How long a round can stay open: the longest window and 30 coordinators' takeovers past it. A closer gives
        up waiting for the round's accepted set after this, so a round that has not closed by then never will."""
        return self.max_deadline_s + 30 * self.takeover_s

    def admits(self, peer_id: str) -> bool:
        """Whether ``peer_id``'s round records count in this run (the manifest's allow-list)."""
        return not self.allowed_peers or peer_id in self.allowed_peers


@dataclass
class RoundStats:
    """What one round cost this peer; the simulate summary aggregates these."""

    round: int
    contributed: bool = False
    accepted: bool = False
    members: int = 0
    compute_s: float = 0.0  # the inner phase's seconds, less turn_wait_s
    comm_s: float = 0.0
    wait_s: float = 0.0
    # seconds the phase's training steps waited for the overlapped exchange's forward passes (hlbp.peer.train.turns):
    # time neither trained nor communicated, so not compute
    turn_wait_s: float = 0.0
    # the collection window this peer held for the round (rules.adapt_window, widen_for_late): how long a
    # coordinator waits past the first contribution for the rest, when one is missing
    window_s: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    records_received: int = 0  # round records pushed to this peer or returned by its DHT reads since its last report
    records_sent: int = 0  # round records it pushed since its last report
    bytes_analytic: bool = False  # dense all-reduce: bytes computed from the group size, not counted
    in_sync: bool = True
    synced: bool = False
    # after a resync in this round: the (later) round whose state the checksums and the validation loss describe;
    # a peer that fell behind loads the swarm's latest state, not this round's
    state_round: int | None = None
    checksums: dict[int, str] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)  # seconds per protocol step, to see where comm goes
    # under eager overlap: inner steps of the next phase trained before this round's result landed in it (None: it
    # landed at that phase's end, or there was no overlap)
    landed_after: int | None = None
    # under eager overlap: inner steps of the next phase trained before each partial result of this round (ours and
    # the contributions fetched so far) landed in it, ahead of the result itself (rounds/overlap_loop.py)
    previews: list[int] = field(default_factory=list)
    # largest contribution and update norm ratios seen, and "loss" ("anchor_loss"): the guard batch's loss of the
    # result (of the anchor it is judged against), when known
    guard: dict[str, float] = field(default_factory=dict)
    copies: list[dict[str, Any]] = field(default_factory=list)  # evidence of copied contributions (rounds/copies.py)
    refused: str = ""  # why the round was refused as a whole (nobody's parameters moved), if it was
    banned: list[str] = field(default_factory=list)  # peers the round's accepted set says are banned
    # a stage peer's contribution left out because it was computed with frames from a peer banned in this round: it
    # was dropped, not kept in the error-feedback buffer, and the stage's AdamW moments were forgotten
    tainted: bool = False
    # our contribution was left out with a chain of frames the coordinator could not take (its accepted set names us
    # ``dropped``): its phase was taken out of the error-feedback buffer, not kept to be sent again
    dropped: bool = False
