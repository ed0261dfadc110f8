"""The driver's typed events and step state, without a network: every upstream op decodes to its event, the
others are a ProtocolError, and the step's bookkeeping says what is in flight, unsent and past its deadline."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from hlbp.peer.swarm.events import (
    Backward,
    BadPeer,
    Done,
    EventQueue,
    FailReport,
    Loss,
    Pong,
    UnexpectedMessage,
    decode_answer,
)
from hlbp.peer.swarm.step import StepState, micro_batches
from hlbp.protocol import ProtocolError
from hlbp.protocol.stagewire import DOWNSTREAM, UPSTREAM, Reason, StageMessage

STAGE = "12D3KooWstage"
OTHER = "12D3KooWother"


@dataclass(frozen=True)
class FakeConn:
    peer: str


def test_each_upstream_op_decodes_to_its_event() -> None:
    conn = FakeConn(STAGE)
    bwd = decode_answer(conn, StageMessage("bwd", session=1, step=2, mb=3), b"frame")
    assert isinstance(bwd, Backward) and bwd.body == b"frame" and bwd.conn is conn and bwd.msg.mb == 3
    assert isinstance(decode_answer(conn, StageMessage("loss", loss=1.5), b""), Loss)
    assert isinstance(decode_answer(conn, StageMessage("done", scale=0.5), b""), Done)
    assert decode_answer(conn, StageMessage("pong", code=Reason.ROUND), b"") == \
        Pong(conn, StageMessage("pong", code=Reason.ROUND), exchanging=True)
    pong = decode_answer(conn, StageMessage("pong"), b"")
    assert isinstance(pong, Pong) and not pong.exchanging


def test_a_fail_names_the_failed_peer_or_its_sender_and_carries_its_code() -> None:
    conn = FakeConn(STAGE)
    named = decode_answer(conn, StageMessage("fail", peer=OTHER, code=Reason.ALREADY_APPLIED), b"")
    assert isinstance(named, FailReport) and named.peer == OTHER and named.code is Reason.ALREADY_APPLIED
    unnamed = decode_answer(conn, StageMessage("fail", code=Reason.STREAM_CLOSED), b"")
    assert isinstance(unnamed, FailReport) and unnamed.peer == STAGE and unnamed.code is Reason.STREAM_CLOSED


@pytest.mark.parametrize("op", sorted(DOWNSTREAM))
def test_an_op_that_only_travels_downstream_is_a_protocol_error(op: str) -> None:
    with pytest.raises(UnexpectedMessage, match=f"a {op} message sent to the driver") as info:
        decode_answer(FakeConn(STAGE), StageMessage(op), b"")
    assert isinstance(info.value, ProtocolError)


def test_every_upstream_op_has_an_event() -> None:
    for op in UPSTREAM:
        decode_answer(FakeConn(STAGE), StageMessage(op), b"")


def test_an_answer_belongs_to_one_session_and_step() -> None:
    done = decode_answer(FakeConn(STAGE), StageMessage("done", session=5, step=7), b"")
    assert done.belongs_to(5, 7)
    assert not done.belongs_to(5, 6) and not done.belongs_to(4, 7)


def test_micro_batches_split_the_batch_weighted_by_their_targets() -> None:
    x, y = torch.zeros(5, 3), torch.ones(5, 3)
    mbs = micro_batches(x, y, 2)
    assert [m.x.shape[0] for m in mbs] == [3, 2]
    assert sum(m.weight for m in mbs) == pytest.approx(1.0) and mbs[0].weight == pytest.approx(0.6)
    assert len(micro_batches(x, y, 8)) == 5  # never more micro-batches than rows


def _step() -> StepState:
    return StepState(micro_batches(torch.zeros(4, 2), torch.zeros(4, 2), 4), [STAGE], window=2, opt_step=0, lr=0.1,
                     tokens=8, round_end=False, give_up=None, started=0.0)


def test_the_step_knows_what_is_in_flight_unsent_and_oldest() -> None:
    step = _step()
    assert step.unsent() == [0, 1, 2, 3] and step.inflight() == [] and step.oldest_sent() is None
    for i, at in ((0, 10.0), (1, 12.0)):
        step.mbs[i].attempt, step.mbs[i].sent_at = 0, at
    assert step.inflight() == [0, 1] and step.unsent() == [2, 3] and step.oldest_sent() == 10.0
    step.mbs[0].done, step.mbs[0].loss = True, 2.0
    step.mbs[1].sent_at = 0.0  # to be sent again
    assert step.inflight() == [] and step.unsent() == [1, 2, 3]
    step.finishing, step.finish_at = True, 20.0
    assert step.oldest_sent() == 20.0  # the finish's deadline counts once it is under way
    assert step.loss() == pytest.approx(2.0 * 0.25)


def test_the_inbox_collects_pongs_and_keeps_every_other_event_in_order() -> None:
    inbox = EventQueue()
    assert inbox.get(0.0) is None
    early = decode_answer(FakeConn(STAGE), StageMessage("done", step=1), b"")
    bad = BadPeer(OTHER, "a frame that does not decode")
    inbox.put(early)
    inbox.put(decode_answer(FakeConn(STAGE), StageMessage("pong", code=Reason.ROUND), b""))
    inbox.put(bad)
    inbox.put(decode_answer(FakeConn(OTHER), StageMessage("pong"), b""))
    assert inbox.pongs(2, 1.0) == ({STAGE, OTHER}, {STAGE})
    assert inbox.get(0.0) == early and inbox.get(0.0) == bad and inbox.get(0.0) is None
    assert inbox.pongs(1, 0.05) == (set(), set())  # nobody answers in time


def test_an_abandoned_step_says_why_as_a_cause_and_as_text() -> None:
    from hlbp.peer.swarm.step import Abandon, StepAbandoned

    exc = StepAbandoned(Abandon.ALREADY_APPLIED, "12D3KooWstage… applied step 3 already")
    assert exc.cause is Abandon.ALREADY_APPLIED and str(exc) == "12D3KooWstage… applied step 3 already"
