"""Quick, seeded run of the structure-aware decoder fuzzer (tests/fuzz/fuzzlib.py) in the normal suite.

Every family gets a few hundred mutated inputs; each call must succeed or raise the family's one error type,
pass the family's oracle when it succeeds, take under a second and not raise peak RSS by 64 MiB. The long run is
``python tests/fuzz/run.py --inputs 100000 --out fuzz.json``.
"""

from __future__ import annotations

import pytest
from fuzzlib import FAMILY_BUILDERS, run_family

INPUTS = 800


@pytest.mark.parametrize("family", list(FAMILY_BUILDERS))
def test_decoders_keep_their_contract(family: str) -> None:
    report = run_family(family, INPUTS, seed=1234)
    assert report.inputs == INPUTS
    assert report.ok, "\n\n".join(report.findings)
    assert report.rejected > 0  # the mutations reach the decoder's checks
