"""A contribution adds the kept error feedback into the phase's delta a block at a time: with the buffer in a file,
the host's peak while contributing grows by the delta and the narrowed result, not also by the buffer widened to
float32 beside them (the largest parameter's copies were a full replica's peak at a round's contribution)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_SCRIPT = textwrap.dedent("""
    import gc, json, sys
    from pathlib import Path
    import torch
    from hlbp.peer.common.memory import current_host_bytes, trim
    from hlbp.peer.rounds.outer import OuterConfig, SparseLoCo

    folder = Path(sys.argv[1])
    shape = (16384, 4096)  # 256 MiB in float32
    anchor = {"emb": torch.randn(shape, generator=torch.Generator().manual_seed(0))}
    local = {"emb": anchor["emb"] - 0.01}
    opt = SparseLoCo(OuterConfig(k=64, beta=0.95, ef_dtype="bf16", ef_dir=str(folder)))
    opt.ef["emb"] = torch.full(shape, 0.001, dtype=torch.bfloat16)
    gc.collect()
    trim()
    before = current_host_bytes()
    Path("/proc/self/clear_refs").write_text("5")  # the peak from here on
    opt.contribute(anchor, local)
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    print(json.dumps({"grown_mib": (peak - before) / 2**20}))
""")


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's clear_refs")
def test_a_contribution_holds_the_delta_and_a_block_of_the_kept_buffer(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    grown = json.loads(done.stdout.strip().splitlines()[-1])["grown_mib"]
    # a 256 MiB parameter: its float32 delta (256) and the narrowed buffer written back (128) make 384; the buffer
    # read whole and widened beside the delta made 640 (bf16 read 128, float32 256)
    assert grown < 512, grown
