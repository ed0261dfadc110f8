"""The audit's pure core on frames made here with the real codec and a real stage: an honest frame is clean
(exactly, at the anchor), and each way a frame can lie or fail to prove anything gets its own finding."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from hlbp.peer.model.codec import CodecConfig
from hlbp.peer.model.decoder import load_from_full, preset, split
from hlbp.peer.model.pipeline import initial_state
from hlbp.peer.model.subspace import make_codec
from hlbp.peer.swarm.audit import (
    AuditResult,
    Comparison,
    Evidence,
    Finding,
    Tolerance,
    audit,
    compare,
    judge_step,
)
from hlbp.peer.swarm.auditor import choose
from hlbp.peer.train.trainer import skeleton
from hlbp.protocol.stagewire import StageMessage, encode_tokens, split_body

CONFIG = preset("tiny", vocab_size=300, n_layers=3)
CODEC = make_codec(CodecConfig("dense", wire_dtype="fp32"), CONFIG.d_model, CONFIG.vocab_size, CONFIG.max_seq_len)
LABELS = StageMessage("fwd", session=9, step=4, mb=2, attempt=1, weight=0.5, round=3, inner=0)


def stage(i: int) -> torch.nn.Module:
    s = split(CONFIG, 3)[i]
    load_from_full(s, initial_state(CONFIG, 0))
    return s


def honest(i: int, lie: float = 1.0, bf16: bool = False) -> tuple[torch.nn.Module, Evidence]:
    """Frames of micro-batch LABELS through stage ``i`` computed honestly (the output or input gradient times
    ``lie``), in float32 or (``bf16``) under bf16 autocast, as a peer on a GPU computes."""
    torch.manual_seed(3)
    s = stage(i)
    x = torch.randn(2, 8, CONFIG.d_model)
    ids = torch.randint(0, CONFIG.vocab_size, (2, 8))
    targets = encode_tokens(ids, ids, CONFIG.vocab_size)
    leaf = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = s(leaf)
        loss = s.loss(out, ids) * LABELS.weight if s.is_last else None
    x_frame = (LABELS, CODEC.encode_forward(x, ids) + targets)
    bwd = replace(LABELS, op="bwd", weight=1.0)
    if loss is not None:
        (g,) = torch.autograd.grad(loss, leaf)
        return s, Evidence(x_frame, None, None, (bwd, CODEC.encode_backward(g * lie)))
    g_out = torch.randn(out.shape)
    (g,) = torch.autograd.grad(out, leaf, g_out.to(out.dtype))
    y = (LABELS, CODEC.encode_forward(out.detach().float() * lie, ids) + targets)
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


def test_a_peer_computing_in_bf16_is_judged_by_the_auditors_own_gap_between_precisions() -> None:
    """A peer on a GPU computes under bf16 autocast, its auditor here in float32: their frames differ by bf16's
    rounding, which grows with the stage (1.7e-2 for a 1b stage, near Tolerance.exact). Made tight here so the
    precision check decides: the auditor recomputes in bf16 too, and the frame passes within ``precision`` times
    the gap between its own two results; a frame 10 % off does not."""
    tight = Tolerance(exact=1e-6)
    for i in (1, 2):
        s, e = honest(i, bf16=True)
        found = audit(s, CODEC, CONFIG.vocab_size, e, tight)
        assert found.finding is Finding.CLEAN, found
        sent = [c for c in (found.forward, found.backward) if c is not None]
        noise = [c for c in (found.forward_noise, found.backward_noise) if c is not None]
        assert sent and all(c.error > tight.exact for c in sent) and len(noise) == len(sent)
        assert all(0 < n.error < 0.05 for n in noise)
        assert audit(s, CODEC, CONFIG.vocab_size, e, replace(tight, precision=0.0)).finding is Finding.STALE
    s, e = honest(1, lie=1.1, bf16=True)
    assert audit(s, CODEC, CONFIG.vocab_size, e, tight).finding is Finding.STALE
    s, e = honest(1, lie=-1.0, bf16=True)
    assert audit(s, CODEC, CONFIG.vocab_size, e, tight).finding is Finding.FORWARD
    s, e = honest(1)  # in float32 on both sides: exact, and no second recomputation is made
    found = audit(s, CODEC, CONFIG.vocab_size, e, tight)
    assert found.finding is Finding.CLEAN and found.forward_noise is None and found.backward_noise is None


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


def stage_zero(codec: object = CODEC, lie: Callable[[torch.Tensor], torch.Tensor] = lambda h: h,
               rows: int = 3, seq: int = 8, first: torch.Tensor | None = None) -> tuple[torch.nn.Module, Evidence]:
    """Stage 0's frames of micro-batch LABELS (its output passed through ``lie``) with a codec that carries no
    token ids: what an auditor holds is its output frame and the token window it signed with it (``first``: the
    first input ids it put there, when they are not the ones it computed from)."""
    torch.manual_seed(5)
    s = stage(0)
    stream = torch.randint(0, CONFIG.vocab_size, (rows, seq + 1))
    ids, targets = stream[:, :-1], stream[:, 1:]
    out = s(ids).detach()
    shown = ids if first is None else torch.cat([first.view(-1, 1), ids[:, 1:]], 1)
    y = (LABELS, codec.encode_forward(lie(out), ids) + encode_tokens(shown, targets, CONFIG.vocab_size))
    g_out = (replace(LABELS, op="bwd", weight=1.0), codec.encode_backward(torch.randn_like(out)))
    return s, Evidence(None, y, g_out, None)


def test_a_middle_stage_that_passes_on_other_tokens_than_it_received_is_convicted_at_any_step() -> None:
    s, e = honest(1)
    assert e.x is not None and e.y is not None
    window = len(e.y[1]) - len(split_body(e.y[1], CONFIG.vocab_size)[0])
    stream = torch.randint(0, CONFIG.vocab_size, (2, 9))
    other = encode_tokens(stream[:, :-1], stream[:, 1:], CONFIG.vocab_size)
    assert len(other) == window  # a well-formed window, only not the one it received
    swapped = replace(e, y=(e.y[0], e.y[1][:-window] + other))
    found = audit(s, CODEC, CONFIG.vocab_size, swapped)
    assert found.finding is Finding.FORWARD and "tokens" in found.detail
    later = Evidence(*((replace(f[0], inner=3), f[1]) for f in (swapped.x, swapped.y, swapped.g_out, swapped.g_in)))
    assert audit(s, CODEC, CONFIG.vocab_size, later).finding is Finding.FORWARD  # exact whatever the drift
    assert audit(s, CODEC, CONFIG.vocab_size, e).finding is Finding.CLEAN


def test_stage_zero_is_audited_exactly_from_its_output_frame_and_token_window_without_token_ids() -> None:
    s, e = stage_zero()
    honest = audit(s, CODEC, CONFIG.vocab_size, e)
    assert honest.finding is Finding.CLEAN and honest.forward.error < 1e-5  # its inputs read from its window
    assert audit(skeleton(s), CODEC, CONFIG.vocab_size, e, params=dict(s.named_parameters())).finding \
        is Finding.CLEAN
    small = make_codec(CodecConfig("dense", wire_dtype="bf16"), CONFIG.d_model, CONFIG.vocab_size,
                       CONFIG.max_seq_len, max_tokens=24)
    _, e_small = stage_zero(small)
    assert audit(s, small, CONFIG.vocab_size, e_small).finding is Finding.CLEAN
    noise = lambda h: torch.randn_like(h) * h.std()
    first_only = lambda h: torch.cat([h[:, :1] + torch.randn_like(h[:, :1]) * h.std(), h[:, 1:]], 1)
    for lie in (lambda h: h * 10, noise, lambda h: -h):
        _, lying = stage_zero(lie=lie)
        assert audit(s, CODEC, CONFIG.vocab_size, lying).finding is Finding.FORWARD
    # a lie at position 0 alone: the frame is not the anchor's, so the work is refused (here near enough to look
    # computed on other weights: stale, which refuses without a ban)
    _, lying = stage_zero(lie=first_only)
    assert audit(s, CODEC, CONFIG.vocab_size, lying).finding in (Finding.FORWARD, Finding.STALE)
    # first input ids in its window other than those it computed from: its signed frame and window disagree
    _, lying = stage_zero(first=torch.tensor([1, 2, 3]))
    assert audit(s, CODEC, CONFIG.vocab_size, lying).finding in (Finding.FORWARD, Finding.STALE)
    assert audit(s, CODEC, CONFIG.vocab_size, replace(e, y=None)).finding is Finding.INCONCLUSIVE


def test_stage_zero_under_a_subspace_codec_of_any_rank_is_audited_exactly() -> None:
    s = stage(0)
    for rank in ("1", "2", "1/8"):
        codec = make_codec(CodecConfig("subspace-a", rank=rank, wire_dtype="fp32"), CONFIG.d_model,
                           CONFIG.vocab_size, CONFIG.max_seq_len)
        _, e = stage_zero(codec)
        assert audit(s, codec, CONFIG.vocab_size, e).finding is Finding.CLEAN, rank  # never inconclusive now


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


def test_per_token_numbers_are_medians_over_rows_so_one_large_row_does_not_decide() -> None:
    mine = torch.ones(5, 4)
    sent = mine.clone()
    sent[0] = -100.0  # one row, flipped and huge: it dominates the whole micro-batch's cosine
    c = compare(sent, mine)
    assert c.cosine < 0 and c.ratio > 20
    assert (c.token_cosine, c.token_ratio) == (1.0, 1.0)
    noise = compare(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]]), torch.tensor([[0.0, 2.0]] * 3))
    assert (noise.token_cosine, noise.token_ratio) == (0.0, 0.5)
    zero = compare(torch.zeros(2, 3), torch.zeros(2, 3))
    assert (zero.token_cosine, zero.token_ratio) == (1.0, 1.0)


def later_result(cos: float, ratio: float, inner: int = 2, backward: Comparison | None = None) -> AuditResult:
    return AuditResult(Finding.UNJUDGED, inner, Comparison(1.0, cos, ratio, cos, ratio), backward)


def test_a_later_frame_is_judged_by_its_informative_siblings_of_the_same_step() -> None:
    t = Tolerance()
    honest = [Comparison(1.0, 0.9, 1.2, 0.9, 1.2), Comparison(1.0, 0.75, 1.5, 0.75, 1.5)]
    assert t.later(Comparison(1.0, 0.6, 1.7, 0.6, 1.7), honest)  # drift alike: within 0.4 and 3x of one
    for lie in ((0.02, 1.3), (-0.85, 1.3), (0.9, 12.0), (0.9, 0.1), (float("nan"), 1.0), (0.9, float("inf"))):
        assert t.later(Comparison(1.0, lie[0], lie[1], *lie), honest) is False, lie
    assert t.later(Comparison(1.0, 0.9, 1.2, 0.9, 1.2), []) is None
    # siblings drifted too far to say anything (or are lies themselves): the frame is not judged
    assert t.later(Comparison(1.0, 0.02, 1.3, 0.02, 1.3), [Comparison(1.0, 0.3, 3.0, 0.3, 3.0)]) is None
    assert t.later(Comparison(1.0, 0.9, 1.2, 0.9, 1.2), [Comparison(1.0, 0.0, 1.0, 0.0, 1.0)]) is None


def test_judge_step_convicts_the_odd_frame_of_a_step_and_leaves_other_findings_alone() -> None:
    step = [later_result(0.9, 1.2), later_result(0.85, 1.3), later_result(0.0, 1.25), later_result(0.88, 1.1)]
    first = AuditResult(Finding.CLEAN, 0, Comparison(0.0, 1.0, 1.0), None)
    other = later_result(0.0, 1.0, inner=3)  # alone in its step: nothing to judge it against
    out = judge_step([first, *step, other])
    assert out[0] is first and out[-1] == other
    assert [r.finding for r in out[1:5]] == [Finding.CLEAN, Finding.CLEAN, Finding.FORWARD, Finding.CLEAN]
    assert out[3].detail and out[3].forward == step[2].forward
    # a backward lie in a frame whose forward is honest
    b_ok, b_lie = Comparison(1.0, 0.95, 1.1, 0.95, 1.1), Comparison(1.0, 0.95, 10.4, 0.95, 10.4)
    pair = [later_result(0.9, 1.2, backward=b_ok), later_result(0.9, 1.2, backward=b_lie),
            later_result(0.9, 1.2, backward=b_ok)]
    assert [r.finding for r in judge_step(pair)] == [Finding.CLEAN, Finding.BACKWARD, Finding.CLEAN]
    # the first step's findings are never siblings of a later step's
    assert judge_step([AuditResult(Finding.FORWARD, 0, Comparison(9.0, 1.0, 10.0, 1.0, 10.0), None),
                       later_result(1.0, 10.0)])[1].finding is Finding.UNJUDGED


def test_choose_draws_first_step_attempts_and_a_group_from_one_later_step() -> None:
    sent = {(1, 0, mb, 0): 0 for mb in range(4)} | {(1, 1, mb, 0): 1 for mb in range(4)}
    sent |= {(1, 2, 0, 0): 2}  # a later step with one attempt only: never the drawn group
    for seed in range(20):
        picked = choose(sent, 2, seed, later=3)
        assert len(picked) == 5 and len(set(picked)) == 5
        assert sum(sent[k] == 0 for k in picked) == 2
        assert {k[1] for k in picked if sent[k]} == {1}
        assert picked == choose(sent, 2, seed, later=3)  # the seed decides
    assert choose(sent, 2, 0) == choose(sent, 2, 0, later=0) and len(choose(sent, 2, 0)) == 2
    assert len(choose({(1, 2, 0, 0): 2}, 2, 0, later=3)) == 1  # no step of two: the lone attempt is still compared


def test_choose_draws_what_a_screen_marked_first_and_a_sibling_beside_it() -> None:
    sent = {(1, s, mb, 0): s for s in range(4) for mb in range(4)}
    for seed in range(20):
        picked = choose(sent, 1, seed, later=2, flagged={(1, 0, 3, 0), (1, 2, 1, 0)})
        assert picked[0] == (1, 0, 3, 0) and picked[1] == (1, 2, 1, 0)
        assert len(picked) == 3 and picked[2][1] == 2 and picked[2] != picked[1]  # a sibling of the marked one
    both = {(1, 3, 0, 0), (1, 3, 2, 0)}
    assert set(choose(sent, 1, 5, later=3, flagged=both)[1:]) >= both  # room left for one unmarked sibling


def test_an_unmarked_peers_later_step_is_drawn_with_the_configured_chance_a_marked_one_always() -> None:
    sent = {(1, s, mb, 0): s for s in range(4) for mb in range(4)}
    drawn = [len(choose(sent, 1, seed, later=2, later_chance=0.5)) == 3 for seed in range(200)]
    assert 70 < sum(drawn) < 130  # about half, decided by the seed
    assert all(len(choose(sent, 1, seed, later=2, later_chance=0.0)) == 1 for seed in range(20))
    marked = {(1, 2, 1, 0)}
    assert all((1, 2, 1, 0) in choose(sent, 1, seed, later=2, flagged=marked, later_chance=0.0) for seed in range(20))
