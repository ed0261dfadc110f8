"""Structure-aware fuzzing of every decoder of network or file input (the hostile-peers contract).

Each :class:`Family` builds VALID inputs with the real encoders (contribution envelopes with sparse and dense
bodies, sealed manifests and announcements, signed round records, state-sync blobs, activation frames, dense
safetensors bodies, checkpoint files, data-plane headers, zstd frames), then mutates inside the structure
(:mod:`mutators`) and, for signed or digested inputs, re-signs / re-digests after the mutation so the deep
parsing runs. :func:`run_family` checks every call: it may only succeed or raise the family's allowed error
(``ProtocolError``; ``UserInputError`` for the checkpoint loader), must finish in under a second, and must not
raise the process's peak RSS by more than a bound.
"""

from __future__ import annotations

import random
import resource
import signal
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from families import FAMILY_BUILDERS, Family  # noqa: F401 - re-exported for run.py and the tests
from oracles import BadAccept

MAX_CALL_S = 1.0
"""Longest a single decode may take."""
MAX_RSS_GROWTH = 64 << 20
"""Largest rise of the process's peak RSS one decode may cause (inputs here expect at most a few hundred KB)."""
HANG_S = 10
"""A call still running after this long is interrupted and counted as a hang."""


# --- the checker -------------------------------------------------------------------------------------------------


@dataclass
class Report:
    """Outcomes of one family's run."""

    family: str
    inputs: int = 0
    rejected: int = 0
    accepted: int = 0
    bad_accept: int = 0  # accepted, but the family's oracle says the input was malformed
    other: int = 0
    slow: int = 0
    memory: int = 0
    slowest_s: float = 0.0
    peak_rss_growth: int = 0  # bytes the process's peak RSS rose during the fuzzing calls
    findings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.other == 0 and self.bad_accept == 0 and self.slow == 0 and self.memory == 0


class _Hang(BaseException):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise _Hang()


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def run_family(name: str, inputs: int, seed: int = 0, max_findings: int = 10) -> Report:
    """Feed ``inputs`` mutated inputs to one family's decoders and check each call's outcome, time and memory."""
    family = FAMILY_BUILDERS[name]()
    rng = random.Random(f"{seed}|{name}")
    report = Report(name)
    for inp in family.honest:  # warm up caches and lazy imports before measuring memory; honest input must pass
        out = family.decode(inp)
        if family.check is not None:
            family.check(inp, out)
    for _ in range(5):
        family.make(rng)  # builds lazy fixtures (the zstd bomb) outside the measured calls
    base = _maxrss()
    use_alarm = hasattr(signal, "SIGALRM")
    if use_alarm:
        old = signal.signal(signal.SIGALRM, _alarm)
    try:
        for i in range(inputs):
            inp = family.make(rng)
            before = _maxrss()
            t0 = time.perf_counter()
            outcome, detail = "accepted", ""
            try:
                if use_alarm:
                    signal.alarm(HANG_S)
                try:
                    result = family.decode(inp)
                    if family.check is not None:
                        family.check(inp, result)
                except BadAccept as exc:
                    outcome, detail = "bad_accept", f"accepted a malformed input: {exc}"
                except family.allowed:
                    outcome = "rejected"
                except _Hang:
                    raise
                except BaseException as exc:  # noqa: BLE001 - every other exception is a finding
                    outcome = "other"
                    detail = f"{type(exc).__name__}: {str(exc)[:200]}\n{traceback.format_exc(limit=-3)[-1500:]}"
                finally:
                    if use_alarm:
                        signal.alarm(0)
            except _Hang:  # raised in the call, or just as it returned
                outcome, detail = "other", f"hang over {HANG_S} s"
            dt = time.perf_counter() - t0
            grew = _maxrss() - before
            report.inputs += 1
            report.slowest_s = max(report.slowest_s, dt)
            if outcome == "rejected":
                report.rejected += 1
            elif outcome == "accepted":
                report.accepted += 1
            elif outcome == "bad_accept":
                report.bad_accept += 1
            else:
                report.other += 1
            if dt > MAX_CALL_S:
                report.slow += 1
                detail = detail or f"call took {dt:.2f} s"
            if grew > MAX_RSS_GROWTH:
                report.memory += 1
                detail = detail or f"peak RSS rose by {grew >> 20} MiB"
            if detail and len(report.findings) < max_findings:
                report.findings.append(f"#{i}: {detail}\ninput: {_describe(inp)}")
    finally:
        if use_alarm:
            signal.signal(signal.SIGALRM, old)
    report.peak_rss_growth = _maxrss() - base
    return report


def _describe(inp: Any) -> str:
    data = inp[-1] if isinstance(inp, tuple) else inp
    return f"{len(data)} bytes, head {bytes(data[:48]).hex()}" if isinstance(data, (bytes, bytearray)) else repr(inp)
