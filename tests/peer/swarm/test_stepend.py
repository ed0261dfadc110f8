"""A stage's step-end ledger (pure): when its backward carries the norms up, and which ``apply`` or ``done`` it
takes."""

from __future__ import annotations

from hlbp.peer.swarm.stepend import StepLedger
from hlbp.peer.swarm.worker import clip_scale, wire_norm, wire_scale
from hlbp.peer.train.trainer import OptimConfig, lr_at
from hlbp.protocol.stagewire import StageMessage

OPTIM = OptimConfig(lr=1e-3, warmup_steps=1, total_steps=10)


def _fwd(step: int = 3, count: int = 4) -> StageMessage:
    return StageMessage("fwd", session=9, step=step, count=count)


def _apply(total: float, step: int = 3, lr: float | None = None, scale: float | None = None) -> StageMessage:
    return StageMessage("apply", session=9, step=step, opt_step=2, lr=lr_at(2, OPTIM) if lr is None else lr,
                        max_norm=OPTIM.grad_clip, sumsq=total,
                        scale=clip_scale(total, OPTIM.grad_clip) if scale is None else scale)


def test_the_norm_goes_up_only_with_the_backward_that_completes_the_step_and_everything_below() -> None:
    ledger = StepLedger()
    ledger.started(_fwd())
    asked: list[int] = []

    def own() -> float:
        asked.append(1)
        return 2.0

    bwd = StageMessage("bwd", session=9, step=3)
    assert ledger.norms(bwd, 5.0, 3, own) == (0.0, 0) and not asked  # 3 of 4 micro-batches: not yet, not computed
    assert ledger.norms(bwd, None, 4, own) == (0.0, 0)  # the stages below did not say theirs
    assert ledger.norms(StageMessage("bwd", session=9, step=2), 5.0, 4, own) == (0.0, 0)  # another step
    assert ledger.norms(bwd, 5.0, 4, own) == (7.0, 4) and ledger.reported == (9, 3, 7.0)
    assert ledger.below(StageMessage("bwd", session=9, step=3, sumsq=5.0, count=4)) == 5.0
    assert ledger.below(StageMessage("bwd", session=9, step=3, sumsq=5.0, count=0)) is None
    assert ledger.below(StageMessage("bwd", session=9, step=3, sumsq=5.0, count=3)) is None  # not this step's count


def test_an_apply_is_taken_only_for_a_step_whose_norm_went_up_and_as_that_norm_allows() -> None:
    ledger = StepLedger()
    ledger.started(_fwd())
    assert ledger.apply_fault(_apply(9.0), OPTIM) is not None  # nothing sent up yet: not asked for
    ledger.norms(StageMessage("bwd", session=9, step=3), 0.0, 4, lambda: 7.0)
    assert ledger.apply_fault(_apply(9.0), OPTIM) is None  # the stages above add theirs
    assert ledger.apply_fault(_apply(6.0), OPTIM) is not None  # below what this stage counted
    assert ledger.apply_fault(_apply(9.0, scale=1.0), OPTIM) is not None  # not the factor its norm gives
    assert ledger.apply_fault(_apply(9.0, lr=10.0), OPTIM) is not None  # off the schedule
    assert ledger.apply_fault(_apply(9.0, step=4), OPTIM) is not None  # another step


def test_a_done_is_taken_only_for_the_step_whose_finish_went_down() -> None:
    ledger = StepLedger()
    lr = lr_at(2, OPTIM)
    done = StageMessage("done", session=9, step=3, lr=lr, sumsq=9.0, scale=clip_scale(9.0, OPTIM.grad_clip))
    assert ledger.done_fault(done) is not None  # a done nobody asked for
    ledger.passed_down(StageMessage("finish", session=9, step=3, lr=lr, max_norm=OPTIM.grad_clip), 4.0)
    assert ledger.done_fault(done) is None
    assert ledger.done_fault(StageMessage("done", session=9, step=3, lr=10.0, sumsq=9.0,
                                          scale=clip_scale(9.0, OPTIM.grad_clip))) is not None


def test_a_norm_that_is_not_finite_travels_as_the_largest_and_skips_the_step() -> None:
    assert wire_norm(4.0) == 4.0 and wire_norm(1e308) == 1e300
    assert wire_norm(float("inf")) == 1e300 and wire_norm(float("nan")) == 1e300
    assert wire_scale(4.0, 1.0) == clip_scale(4.0, 1.0)
    assert wire_scale(float("nan"), 1.0) == 0.0 and wire_scale(float("inf"), 0.0) == 1.0  # no clipping: 1
