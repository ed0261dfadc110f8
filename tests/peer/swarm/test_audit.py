"""The audit's pure core on frames made here with the real codec and a real stage: an honest frame is clean
(exactly, at the anchor), and each way a frame can lie or fail to prove anything gets its own finding."""

from __future__ import annotations

from dataclasses import replace

import torch

from hlbp.peer.model.codec import CodecConfig
from hlbp.peer.model.decoder import load_from_full, preset, split
from hlbp.peer.model.pipeline import initial_state
from hlbp.peer.model.subspace import make_codec
from hlbp.peer.swarm.audit import Comparison, Evidence, Finding, Tolerance, audit, compare
from hlbp.peer.train.trainer import skeleton
from hlbp.protocol.stagewire import StageMessage, encode_targets

CONFIG = preset("tiny", vocab_size=300, n_layers=3)
CODEC = make_codec(CodecConfig("dense", wire_dtype="fp32"), CONFIG.d_model, CONFIG.vocab_size, CONFIG.max_seq_len)
LABELS = StageMessage("fwd", session=9, step=4, mb=2, attempt=1, weight=0.5, round=3, inner=0)


def stage(i: int) -> torch.nn.Module:
    s = split(CONFIG, 3)[i]
    load_from_full(s, initial_state(CONFIG, 0))
    return s


def honest(i: int, lie: float = 1.0) -> tuple[torch.nn.Module, Evidence]:
    """Frames of micro-batch LABELS through stage ``i`` computed honestly (the output or input gradient times
    ``lie``)."""
    torch.manual_seed(3)
    s = stage(i)
    x = torch.randn(2, 8, CONFIG.d_model)
    ids = torch.randint(0, CONFIG.vocab_size, (2, 8))
    targets = encode_targets(ids, CONFIG.vocab_size)
    leaf = x.clone().requires_grad_(True)
    out = s(leaf)
    x_frame = (LABELS, CODEC.encode_forward(x, ids) + targets)
    bwd = replace(LABELS, op="bwd", weight=1.0)
    if s.is_last:
        (g,) = torch.autograd.grad(s.loss(out, ids) * LABELS.weight, leaf)
        return s, Evidence(x_frame, None, None, (bwd, CODEC.encode_backward(g * lie)))
    g_out = torch.randn_like(out)
    (g,) = torch.autograd.grad(out, leaf, g_out)
    y = (LABELS, CODEC.encode_forward(out.detach() * lie, ids) + targets)
    return s, Evidence(x_frame, y, (bwd, CODEC.encode_backward(g_out)), (bwd, CODEC.encode_backward(g)))


def test_an_honest_middle_and_last_stage_are_clean_exactly_at_the_anchor() -> None:
    for i in (1, 2):
        s, e = honest(i)
        result = audit(s, CODEC, CONFIG.vocab_size, e)
        assert result.finding is Finding.CLEAN
        for c in (result.forward, result.backward):
            assert c is None or (c.error < 1e-6 and c.cosine > 1 - 1e-9)
    s, e = honest(2, lie=-1.0)  # a last stage that flips the gradient it sends back
    assert audit(s, CODEC, CONFIG.vocab_size, e).finding is Finding.BACKWARD


def test_the_anchor_can_come_as_tensors_run_through_a_skeleton_of_the_stage() -> None:
    _, e = honest(1, lie=10.0)
    found = audit(skeleton(split(CONFIG, 3)[1]), CODEC, CONFIG.vocab_size, e, params=initial_state(CONFIG, 0))
    assert found.finding is Finding.FORWARD and found.forward is not None and abs(found.forward.ratio - 10) < 1e-6


def test_a_frame_near_the_anchors_output_but_not_it_is_stale_not_guilty() -> None:
    s, e = honest(1, lie=1.05)  # what weights near the anchor give: the same direction, 5 % off
    found = audit(s, CODEC, CONFIG.vocab_size, e)
    assert found.finding is Finding.STALE and not found.finding.guilty


def test_a_relabelled_frame_a_broken_signed_frame_and_missing_evidence_get_their_own_findings() -> None:
    s, e = honest(1)
    assert e.y is not None and e.x is not None
    reweighted = replace(e, y=(replace(e.y[0], weight=1.0), e.y[1]))  # it rescaled the loss of what it passed on
    assert audit(s, CODEC, CONFIG.vocab_size, reweighted).finding is Finding.LABELS
    later = replace(e, y=(replace(e.y[0], inner=3), e.y[1]))  # it claimed a later step, for a looser check
    assert audit(s, CODEC, CONFIG.vocab_size, later).finding is Finding.LABELS
    garbage = replace(e, y=(e.y[0], e.y[1][:40] + b"\xff" * (len(e.y[1]) - 40)))
    assert audit(s, CODEC, CONFIG.vocab_size, garbage).finding is Finding.BAD_FRAME
    assert audit(s, CODEC, CONFIG.vocab_size, replace(e, y=None)).finding is Finding.INCONCLUSIVE
    assert audit(s, CODEC, CONFIG.vocab_size, replace(e, x=None)).finding is Finding.INCONCLUSIVE
    bad_input = replace(e, x=(e.x[0], b"\x00" * 10))  # its upstream neighbour's frame: not the audited peer's fault
    assert audit(s, CODEC, CONFIG.vocab_size, bad_input).finding is Finding.INCONCLUSIVE
    # without the output gradient only the forward is checked
    only_forward = audit(s, CODEC, CONFIG.vocab_size, replace(e, g_out=None))
    assert only_forward.finding is Finding.CLEAN and only_forward.backward is None


def test_stage_zero_cannot_be_audited_from_a_codec_that_carries_no_token_ids() -> None:
    _, e = honest(1)
    zero = split(CONFIG, 3)[0]
    assert audit(zero, CODEC, CONFIG.vocab_size, replace(e, x=None)).finding is Finding.INCONCLUSIVE


def test_only_the_phases_first_step_is_judged_and_there_exactly() -> None:
    t = Tolerance()
    assert t.passes(Comparison(0.01, 0.9999, 1.0), 0) and not t.passes(Comparison(0.03, 0.999, 1.0), 0)
    assert t.passes(Comparison(9.0, 0.1, 10.0), 3) is None  # a later step: honest drift can look like this
    assert t.stale(Comparison(0.39, 0.95, 1.19)) and t.stale(Comparison(0.1, 0.995, 0.99))  # measured, one round late
    assert not t.stale(Comparison(9.0, 1.0, 10.0)) and not t.stale(Comparison(2.0, -1.0, 1.0))  # x10, flipped
    assert not t.stale(Comparison(1.4, 0.01, 1.0))  # noise
    s, e = honest(1, lie=10.0)
    assert e.x is not None and e.y is not None and e.g_out is not None and e.g_in is not None
    later = Evidence(*((replace(f[0], inner=2), f[1]) for f in (e.x, e.y, e.g_out, e.g_in)))
    found = audit(s, CODEC, CONFIG.vocab_size, later)
    assert found.finding is Finding.UNJUDGED and found.forward is not None and found.forward.ratio > 9
    c = compare(torch.tensor([3.0, 4.0]), torch.tensor([3.0, 4.0]) * 2)
    assert (c.error, c.cosine, c.ratio) == (0.5, 1.0, 0.5)
    assert compare(torch.zeros(3), torch.zeros(3)) == Comparison(0.0, 1.0, 1.0)
