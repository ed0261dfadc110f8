"""The one place where a test may make a replica misbehave: a fault hook passed in, never a switch in here.

A replica's round loop calls its :class:`FaultHook` at six points: after every inner step, on each shard's
contribution before it is encoded (a well-formed lie: scaled values, an outsized lookup table), on each encoded
payload before it is served (bytes that do not decode, a payload above the size limit), after a round is applied
(a member that dies before it publishes its checksums), and, as coordinator, on the set it is about to publish as
accepted (a coordinator that accepts what it should have refused), and before each DHT store of a round record (a
peer whose stores are lost, so its records reach the others only by push). Production code runs with :data:`NO_FAULTS`,
whose methods change nothing. Tests subclass :class:`FaultHook` and start a replica through an entry point that
accepts one (``hlbp.cli.control_cmds.main(fault_hook=...)``), as torchft's event injector does. The dense
(DiLoCo) runner has no payloads of its own, so it calls only :meth:`inner_step`.
"""

from __future__ import annotations

from typing import Any

from hlbp.peer.rounds.outer import Contribution


class FaultHook:
    """Decides, per round and shard, what to do to this replica's own work; every method defaults to nothing."""

    def inner_step(self, round_: int, step: int) -> None:
        """Called after inner step ``step`` of round ``round_`` (a straggler sleeps here)."""

    def contribution(self, round_: int, shard: int, contribution: Contribution) -> Contribution:
        """The contribution to encode for ``shard`` in place of ``contribution`` (which stays in our own error
        feedback as it was)."""
        return contribution

    def payload(self, round_: int, shard: int, blob: bytes, limit: int) -> bytes:
        """The bytes to serve and announce for ``shard`` in place of ``blob``; ``limit`` is the receivers' cap."""
        return blob

    def applied(self, round_: int) -> None:
        """Called after round ``round_``'s result is applied, before this replica publishes its checksums (a
        member that dies here was accepted and never answers the verification)."""

    def accept(self, round_: int, admitted: dict[str, Any], notices: dict[str, Any]) -> dict[str, Any]:
        """As coordinator: the contributions to publish as accepted (sender -> notice) in place of ``admitted``,
        the ones that passed our checks; ``notices`` are all that arrived (a lying coordinator accepts them all)."""
        return admitted

    def stores(self, key: str) -> bool:
        """Whether to store our round record under DHT ``key`` (it is pushed to the live members either way)."""
        return True


NO_FAULTS = FaultHook()
