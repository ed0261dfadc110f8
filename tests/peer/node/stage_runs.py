"""What the tests of stage peers in a run read from their processes: a peer's record of a round, a stage peer's id."""

from __future__ import annotations

from typing import Any

from hlbp.peer.sim.launcher import Replica


def round_record(records: list[dict[str, Any]], r: int) -> dict[str, Any] | None:
    """The newest of ``records`` for round ``r``, or None."""
    return next((x for x in reversed(records) if x["round"] == r), None)


def stage_peer_id(peer: Replica, stage: int = 1) -> str:
    """The peer id a stage peer prints when it starts serving ``stage``."""
    return peer.proc.wait_for(rf"serving stage {stage} as (\S+)", 60).group(1)
