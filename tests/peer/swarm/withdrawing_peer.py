"""``hlbp join`` as a stage peer that withdraws its work of every round: it computes and passes on honest frames,
but the audit index it serves says each round's work is taken back, as an honest peer's says after a resync
replaced the state its phase trained from. Nothing of its work can then be recomputed, so nothing convicts it,
and its whole chain's work is left out of every round it serves.

Usage: ``python withdrawing_peer.py join ...``. The transport's ``put_lazy_prefix`` is wrapped from here, through
the test entry point :func:`hlbp.peer.node.session.run_join`, so that the index the peer serves under the audit
prefix is re-encoded as withdrawn; the protocol's code calls no hook. Tests build the command with :func:`program`.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any


def withdraw_always(runner: Any) -> None:
    """Wrap ``runner``'s transport so that every audit index it serves withdraws the round's work."""
    from hlbp.protocol.transcript import INDEX_PREFIX, decode_index, encode_index

    transport = runner.transport
    put_lazy_prefix = transport.put_lazy_prefix

    def withdrawing(prefix: str, resolve: Any) -> None:
        def resolved(name: str) -> bytes | None:
            data = resolve(name)
            if data is None or not name.startswith(INDEX_PREFIX):
                return data
            return encode_index(decode_index(data).entries, withdrawn=True)

        put_lazy_prefix(prefix, resolved)

    transport.put_lazy_prefix = withdrawing


def program() -> list[str]:
    """The command that starts a joined stage peer that withdraws its work of every round."""
    return [sys.executable, str(Path(__file__).resolve())]


if __name__ == "__main__":
    from dataclasses import replace

    from hlbp.cli.join_flags import join_plan
    from hlbp.peer.node.session import run_join

    if sys.argv[1:2] != ["join"]:
        sys.exit(f"usage: {sys.argv[0]} join [FLAGS]")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    plan = join_plan(sys.argv[2:])
    plan = replace(plan, stage=replace(plan.stage, round_faults=withdraw_always))
    run_join(plan, lambda line: print(line, flush=True))
