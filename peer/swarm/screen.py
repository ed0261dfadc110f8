"""A cheap screen of a stage boundary: moving statistics of what each neighbour sends, so that audits look at the
outliers first.

An audit recomputes a few sampled micro-batches (:mod:`hlbp.peer.swarm.auditor`); a peer that lies on one
micro-batch in ten is found only when a sample falls on its lie. Every receiver, though, sees every frame its
neighbours send it. A :class:`FrameScreen` keeps, per sender and direction (``fwd``: activations, ``bwd``: gradients),
exponential moving averages of four statistics of the frames (:func:`frame_stats`):

- the scale: the median over the frame's token rows of each row's RMS (a lie x10 moves it 10x);
- the spread: the standard deviation over the token rows of the log of each row's RMS (a model's tokens differ in
  size; Gaussian noise of any scale has a spread of about 1/sqrt(2 d) for d channels);
- the coherence: the mean over the tokens of each token's cosine with the frame's mean token (a model's
  activations share directions; Gaussian noise over n tokens has about 1/sqrt(n));
- the per-channel mean over the frame's tokens, in units of its RMS (a flipped frame turns it around).

Gradients are judged on the first two only: their coherence and mean vary from frame to frame as much as a lie's
would (``ScreenConfig.gradient_outliers``). A frame far from its sender's averages on any statistic judged is an
:class:`Outlier`, and its receiver marks it in the
transcript it serves to auditors (:meth:`hlbp.peer.swarm.transcript.Transcript.flag`); the auditor then draws the
marked micro-batches first. A mark is never a verdict: it only chooses which frames an exact or sibling audit
recomputes, so a receiver that marks honest frames costs nobody anything but its own swarm's audit draw, and one
that hides a lie's mark leaves the draw as it was. An outlier enters the averages clamped to the band's edge, so
honest drift is followed and a rare liar cannot drag them; the averages start from the medians of the first
frames (the warm-up), so a lie among those cannot set them either.
"""

from __future__ import annotations

import math
import statistics
import threading
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from enum import Enum

import torch


class Outlier(Enum):
    """Which statistic of a frame is far from its sender's moving average."""

    SCALE = "scale"
    SPREAD = "spread"
    COHERENCE = "coherence"
    SIGN = "sign"


@dataclass(frozen=True)
class FrameStats:
    """The statistics of one frame (:func:`frame_stats`)."""

    log_scale: float  # log of the median per-token RMS
    log_spread: float  # log of the standard deviation over tokens of the log per-token RMS
    log_coherence: float  # log of the mean over tokens of each token's cosine with the frame's mean token
    mean: torch.Tensor  # per-channel mean over tokens, in units of the frame's RMS (float32)


def frame_stats(t: torch.Tensor) -> FrameStats | None:
    """The screen's statistics of a frame whose last dimension is one token's vector; None for a frame that has
    none (fewer than two tokens, a zero token, or not finite, or so large that its squares are not: nothing to
    compare)."""
    if t.dim() < 1 or t.numel() == 0 or t.shape[-1] == 0:
        return None
    rows = t.detach().float().reshape(-1, t.shape[-1])
    if rows.shape[0] < 2 or not bool(torch.isfinite(rows).all()):
        return None
    rms = rows.pow(2).mean(dim=1).sqrt()
    if not bool(((rms > 0) & torch.isfinite(rms)).all()):  # squares of finite values past 1e19 overflow
        return None
    spread = float(rms.log().std())
    whole = float(rows.pow(2).mean().sqrt())
    mean = rows.mean(dim=0)
    coherence = float((rows @ mean).div(rms * math.sqrt(rows.shape[1]) * mean.norm().clamp_min(1e-30)).mean())
    return FrameStats(math.log(float(rms.median())), math.log(max(spread, 1e-6)), math.log(max(coherence, 1e-3)),
                      mean / whole)


@dataclass(frozen=True)
class ScreenConfig:
    """When a frame is an outlier against its sender's averages (measured: docs/security.md, "Pipeline swarms:
    commitments and audits")."""

    warmup: int = 4  # frames of a sender and direction taken into the averages before any is judged
    decay: float = 0.8  # weight of the past in each average, per frame taken in
    scale: float = 3.0  # a frame whose scale is beyond this factor of the average's
    spread: float = 2.5  # a frame whose spread is below the average's divided by this
    coherence: float = 2.0  # a frame whose coherence is below the average's divided by this
    sign: float = -0.5  # a frame whose mean's cosine with the average mean is below this, when both means say
    mean_floor: float = 0.1  # something: their norms are at least this (in units of the frame's RMS)
    max_senders: int = 256  # boundaries tracked, the least recently seen dropped first
    # what is judged of gradients (``bwd`` frames): their scale and spread. Their coherence and mean carry no sign
    # of a lie: in make demo's swarm an honest gradient's coherence was 0.03-0.3 (noise's level) and the cosine of
    # its mean with the average's -0.83 to 0.99, so those two made 33 of its 36 outliers in 20 rounds (all false)
    gradient_outliers: frozenset[Outlier] = frozenset({Outlier.SCALE, Outlier.SPREAD})


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    na, nb = float(a.norm()), float(b.norm())
    return float(a @ b) / (na * nb) if na > 0 and nb > 0 else 0.0


def _clamp(x: float, lo: float, hi: float) -> float:
    return min(max(x, lo), hi)


class BoundaryScreen:
    """Moving statistics of what one sender sends in one direction, and whether a frame is an outlier."""

    def __init__(self, cfg: ScreenConfig, judged: frozenset[Outlier] = frozenset(Outlier)) -> None:
        self.cfg = cfg
        self.judged = judged  # the statistics that can make a frame an outlier (others are tracked, not judged)
        self.seen = 0
        self.log_scale = 0.0
        self.log_spread = 0.0
        self.log_coherence = 0.0
        self.mean: torch.Tensor | None = None
        self.mean_norm = 0.0  # moving average of the norms of the means not marked as turned
        self._first: list[tuple[Hashable, FrameStats]] = []  # the warm-up's frames, until the averages start

    def judge(self, s: FrameStats) -> frozenset[Outlier]:
        """Which statistics of ``s`` are far from the averages (none before they start, after the warm-up)."""
        if self.mean is None:
            return frozenset()
        out = set()
        if abs(s.log_scale - self.log_scale) > math.log(self.cfg.scale):
            out.add(Outlier.SCALE)
        if s.log_spread < self.log_spread - math.log(self.cfg.spread):
            out.add(Outlier.SPREAD)
        if s.log_coherence < self.log_coherence - math.log(self.cfg.coherence):
            out.add(Outlier.COHERENCE)
        floor = self.cfg.mean_floor
        if (s.mean.shape == self.mean.shape and float(self.mean.norm()) >= floor and float(s.mean.norm()) >= floor
                and _cos(s.mean, self.mean) < self.cfg.sign):
            out.add(Outlier.SIGN)
        return frozenset(out) & self.judged

    def observe(self, t: torch.Tensor, tag: Hashable = None) -> dict[Hashable, frozenset[Outlier]]:
        """Judge a frame (``tag`` names it), then take it into the averages (an outlier clamped to the bands'
        edges). Returns the outliers found by this call, by tag: this frame's, or at the warm-up's end any of the
        warm-up's frames."""
        s = frame_stats(t)
        if s is None:
            return {}
        if self.mean is None or self.mean.shape != s.mean.shape:
            self._first = [(g, f) for g, f in self._first if f.mean.shape == s.mean.shape] + [(tag, s)]
            self.seen = len(self._first)
            if self.seen < self.cfg.warmup:
                return {}
            first = self._first
            self._start()
            found = {g: self.judge(f) for g, f in first}
            return {g: o for g, o in found.items() if o}
        outliers = self.judge(s)
        self._take(s, outliers)
        return {tag: outliers} if outliers else {}

    def _take(self, s: FrameStats, found: frozenset[Outlier]) -> None:
        d, cfg = self.cfg.decay, self.cfg
        assert self.mean is not None
        band = math.log(cfg.scale)
        scale = _clamp(s.log_scale, self.log_scale - band, self.log_scale + band)
        spread = max(s.log_spread, self.log_spread - math.log(cfg.spread))
        coherence = max(s.log_coherence, self.log_coherence - math.log(cfg.coherence))
        self.log_scale = d * self.log_scale + (1 - d) * scale
        self.log_spread = d * self.log_spread + (1 - d) * spread
        self.log_coherence = d * self.log_coherence + (1 - d) * coherence
        # a turned mean is taken in too, its norm clamped to what the sender's unturned means average: one flipped
        # frame in four shrinks the average without turning it, while an honest turn that lasts is followed within a
        # few frames (a mean left out while marked stayed turned away from every later honest frame, marking each)
        norm = float(s.mean.norm())
        if Outlier.SIGN in found:
            taken = s.mean * (self.mean_norm / norm) if norm > self.mean_norm > 0 else s.mean
        else:
            taken = s.mean
            self.mean_norm = d * self.mean_norm + (1 - d) * norm
        self.mean = d * self.mean + (1 - d) * taken
        self.seen += 1

    def _start(self) -> None:
        """Averages from the warm-up's frames: the medians of scale and spread, and the mean of the frames whose
        scale is within the band of the median's (a frame x10 among them sets nothing). The scale's median is the
        lower middle frame's, not the midpoint of the two middle ones: frames at two scales far apart (a sender
        that lies on half of them, or gradients that shrink fast) would leave no frame near a midpoint."""
        first = [f for _, f in self._first]
        self._first = []
        self.log_scale = statistics.median_low(f.log_scale for f in first)
        self.log_spread = statistics.median(f.log_spread for f in first)
        self.log_coherence = statistics.median(f.log_coherence for f in first)
        near = [f.mean for f in first if abs(f.log_scale - self.log_scale) <= math.log(self.cfg.scale)]
        self.mean = torch.stack(near).mean(dim=0)
        self.mean_norm = statistics.median(float(m.norm()) for m in near)


class FrameScreen:
    """A :class:`BoundaryScreen` per (sender, direction) this peer receives from; thread-safe."""

    def __init__(self, cfg: ScreenConfig | None = None) -> None:
        self.cfg = cfg or ScreenConfig()
        self._boundaries: OrderedDict[tuple[str, str], BoundaryScreen] = OrderedDict()
        self._lock = threading.Lock()
        self.flagged = 0  # frames found outlying, for the summary

    def _judged(self, op: str) -> frozenset[Outlier]:
        return self.cfg.gradient_outliers if op == "bwd" else frozenset(Outlier)

    def observe(self, sender: str, op: str, t: torch.Tensor, tag: Hashable = None) -> dict[Hashable, frozenset[Outlier]]:
        """Judge a frame ``sender`` sent as ``op`` (``tag`` names it) and take it into that boundary's averages; the
        outliers found, by tag (:meth:`BoundaryScreen.observe`)."""
        with self._lock:
            key = (sender, op)
            screen = self._boundaries.pop(key, None) or BoundaryScreen(self.cfg, self._judged(op))
            self._boundaries[key] = screen
            while len(self._boundaries) > self.cfg.max_senders:
                self._boundaries.popitem(last=False)
            found = screen.observe(t, tag)
            self.flagged += len(found)
            return found
