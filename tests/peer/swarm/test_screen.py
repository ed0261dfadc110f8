"""The screen of a stage boundary: moving statistics of what each neighbour sends, outliers marked for audits.

Pure tests of :mod:`hlbp.peer.swarm.screen` on tensors built here: a sender's frames drift slowly and the screen
follows; a frame x10, one of Gaussian noise at the right scale, and a flipped one stand out; nothing is judged
during the warm-up; an outlier cannot drag the averages; a frame with nothing to compare is passed over."""

from __future__ import annotations

import torch

from hlbp.peer.swarm.screen import BoundaryScreen, FrameScreen, Outlier, ScreenConfig, frame_stats
from hlbp.peer.swarm.transcript import Notary
from hlbp.protocol.identity import Identity
from hlbp.protocol.stagewire import StageMessage

D = 64


def activations(seed: int, drift: float = 1.0) -> torch.Tensor:
    """A frame like a model's: tokens of different sizes around a shared direction, times ``drift``."""
    g = torch.Generator().manual_seed(seed)
    base = torch.linspace(-1.0, 1.0, D)
    size = torch.exp(torch.randn(2, 64, 1, generator=g) * 0.5)
    return (base + 0.5 * torch.randn(2, 64, D, generator=g)) * size * drift


def warmed(cfg: ScreenConfig | None = None) -> BoundaryScreen:
    screen = BoundaryScreen(cfg or ScreenConfig())
    for i in range(6):
        assert screen.observe(activations(i), i) == {}
    return screen


def outliers(screen: BoundaryScreen, t: torch.Tensor) -> frozenset[Outlier]:
    """What ``screen`` finds of frame ``t`` (after the warm-up: the frame's own outliers)."""
    found = screen.observe(t, "this")
    assert set(found) <= {"this"}
    return found.get("this", frozenset())


def test_honest_frames_that_drift_slowly_are_never_outliers() -> None:
    screen = warmed()
    for i in range(60):  # 1.05x a frame: 18x in all, well past the scale band, followed by the averages
        assert outliers(screen, activations(100 + i, 1.05 ** i)) == frozenset(), i


def test_a_scaled_a_noise_and_a_flipped_frame_are_outliers_and_do_not_drag_the_averages() -> None:
    screen = warmed()
    honest = activations(50)
    rms = honest.pow(2).mean().sqrt()
    assert outliers(screen, honest * 10) == {Outlier.SCALE}
    noise = torch.randn(2, 64, D, generator=torch.Generator().manual_seed(9)) * rms
    assert outliers(screen, noise) == {Outlier.SPREAD, Outlier.COHERENCE}
    assert Outlier.SIGN in outliers(screen, -honest)
    for i in range(20):  # a liar on one frame in four: each lie stands out, and never drags the averages so far
        # that an honest frame would (an outlier is taken in clamped to the band's edge)
        assert outliers(screen, activations(60 + i) * 10) == {Outlier.SCALE}
        for j in range(3):
            assert outliers(screen, activations(200 + 3 * i + j)) == frozenset()


def test_a_mean_that_turns_for_good_is_followed_and_a_flip_in_four_is_marked_each_time() -> None:
    screen = warmed()
    # one flipped frame in four: each is marked, and it never turns the average far enough to mark an honest frame
    for i in range(10):
        assert Outlier.SIGN in outliers(screen, -activations(300 + i)), i
        for j in range(3):
            assert outliers(screen, activations(400 + 3 * i + j)) == frozenset(), (i, j)
    # the sender's mean turns around and stays turned (honest drift can do that): marked at first, then followed
    turned = [outliers(screen, -activations(500 + i)) for i in range(30)]
    assert Outlier.SIGN in turned[0]
    settled = next(i for i, o in enumerate(turned) if not o)
    assert settled <= 4 and all(not o for o in turned[settled:]), turned  # measured: 3 marked


def test_gradients_are_judged_on_scale_and_spread_only() -> None:
    screen = FrameScreen()
    for i in range(6):
        assert screen.observe("a", "bwd", activations(i), i) == {}
    honest = activations(50)
    noise = torch.randn(2, 64, D, generator=torch.Generator().manual_seed(9)) * honest.pow(2).mean().sqrt()
    assert screen.observe("a", "bwd", honest * 10, "x10") == {"x10": {Outlier.SCALE}}
    assert screen.observe("a", "bwd", noise, "noise") == {"noise": {Outlier.SPREAD}}
    assert screen.observe("a", "bwd", -honest, "flip") == {}  # a gradient's mean turns honestly too
    for i in range(6):
        assert screen.observe("a", "fwd", activations(i), i) == {}
    assert screen.observe("a", "fwd", noise, "noise") == {"noise": {Outlier.SPREAD, Outlier.COHERENCE}}


def test_the_warm_up_starts_from_medians_and_marks_its_own_outliers_at_its_end() -> None:
    screen = BoundaryScreen(ScreenConfig(warmup=4))
    assert screen.observe(activations(0), 0) == {}
    assert screen.observe(activations(1) * 10, 1) == {}  # a lie among the first frames: nothing judged yet
    for junk in (torch.zeros(2, 4, D), torch.full((2, 4, D), float("nan")), torch.ones(1, 1, D), torch.zeros(0, D),
                 torch.full((2, 4, D), 1e30)):
        assert frame_stats(junk) is None and screen.observe(junk, "junk") == {}
    assert screen.observe(activations(2), 2) == {}
    assert screen.observe(activations(3), 3) == {1: {Outlier.SCALE}}  # the averages start: the lie stands out
    assert outliers(screen, activations(4)) == frozenset()  # and it set nothing


def test_a_warm_up_at_two_scales_far_apart_starts_from_one_of_them() -> None:
    # half the warm-up x100: the midpoint of the two middle scales is 10x from every frame, so the screen must take
    # one frame's scale (a sender could send this on purpose; it crashed the receiver's step once)
    for direction in ("fwd", "bwd"):
        screen = FrameScreen(ScreenConfig(warmup=4))
        frames = [activations(0), activations(1) * 100, activations(2), activations(3) * 100]
        found = {}
        for i, t in enumerate(frames):
            found = screen.observe("a", direction, t, i)
        assert found == {1: {Outlier.SCALE}, 3: {Outlier.SCALE}}, direction
        assert screen.observe("a", direction, activations(4), 4) == {}


def test_the_screen_keeps_one_boundary_per_sender_and_direction_and_at_most_its_bound() -> None:
    screen = FrameScreen(ScreenConfig(warmup=2, max_senders=3))
    for i in range(3):
        screen.observe("a", "fwd", activations(i), i)
    assert screen.observe("a", "fwd", activations(7) * 10, "x") == {"x": {Outlier.SCALE}}
    assert screen.observe("a", "bwd", activations(7) * 10, "y") == {}  # another boundary: not warmed up
    for peer in "bcd":
        screen.observe(peer, "fwd", activations(1))
    assert screen.observe("a", "fwd", activations(8) * 10, "z") == {}  # dropped as least recently seen
    assert screen.flagged == 1


def test_a_notary_marks_the_outlier_it_kept_in_the_index_it_serves() -> None:
    alice, bob = Identity.generate(), Identity.generate()
    sender, receiver = Notary(alice), Notary(bob, screen=FrameScreen(ScreenConfig(warmup=2)))
    for mb in range(4):
        msg = sender.seal(StageMessage("fwd", session=1, step=2, mb=mb, round=0, inner=1), b"body")
        assert receiver.receive(alice.peer_id, msg, b"body") is None
        frame = activations(mb) * (10 if mb == 3 else 1)
        marked = receiver.observe(alice.peer_id, msg, frame)
        assert {k.mb for k in marked} == ({3} if mb == 3 else set())
    assert [e.flagged for e in receiver.transcript.index(0)] == [False, False, False, True]
    assert receiver.observe(alice.peer_id, StageMessage("ping", session=1), activations(0) * 10) == set()
