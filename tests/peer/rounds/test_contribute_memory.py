"""A contribution adds the kept error feedback into the phase's delta a block at a time: with the buffer in a file,
the host's peak while contributing grows by the delta and the narrowed result, not also by the buffer widened to
float32 beside them (the largest parameter's copies were a full replica's peak at a round's contribution)."""

from __future__ import annotations

import textwrap
from pathlib import Path

from peak_growth import needs_clear_refs, peak_growth_mib

_SCRIPT = textwrap.dedent("""
    import sys
    from pathlib import Path
    import torch
    from hlbp.peer.rounds.outer import OuterConfig, SparseLoCo

    folder = Path(sys.argv[1])
    shape = (16384, 4096)  # 256 MiB in float32
    anchor = {"emb": torch.randn(shape, generator=torch.Generator().manual_seed(0))}
    local = {"emb": anchor["emb"] - 0.01}
    opt = SparseLoCo(OuterConfig(k=64, beta=0.95, ef_dtype="bf16", ef_dir=str(folder)))
    opt.ef["emb"] = torch.full(shape, 0.001, dtype=torch.bfloat16)
""")


@needs_clear_refs
def test_a_contribution_holds_the_delta_and_a_block_of_the_kept_buffer(tmp_path: Path) -> None:
    grown = peak_growth_mib(_SCRIPT, "opt.contribute(anchor, local)", tmp_path)
    # a 256 MiB parameter: its float32 delta (256) and the narrowed buffer written back (128) make 384; the buffer
    # read whole and widened beside the delta made 640 (bf16 read 128, float32 256)
    assert grown < 512, grown
