"""`hlbp bench codec` in process, cut down: every row is present, exact on the wire, and the sizes hold."""

from __future__ import annotations

import io
import json
from pathlib import Path

from rich.console import Console

from hlbp.peer.bench.codec import CodecBenchConfig, run_codec_bench

ROWS = {
    "sparseloco k=32 entropy", "sparseloco k=64 entropy", "sparseloco k=64 packed12", "sparseloco k=128 entropy",
    "dense fp32", "dense bf16", "zstd-3 fp32",
}


def test_quick_codec_bench_has_every_row_and_the_expected_sizes(
    tmp_path: Path, cache_dir: Path, one_thread: None
) -> None:
    cfg = CodecBenchConfig.quick(
        warmup_steps=3, inner_steps=3, synthetic_tensors=2, synthetic_shape=(512, 512), repeats=1,
        cache_dir=cache_dir,
    )
    out = tmp_path / "codec.json"
    console = Console(file=io.StringIO(), width=120)
    run_codec_bench(cfg, out, console)
    assert "k=64 packed12" in console.file.getvalue()  # the table was printed
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "codec"
    inputs = doc["result"]["inputs"]
    assert set(inputs) == {"tiny", "synthetic"}
    for inp in inputs.values():
        rows = inp["rows"]
        assert set(rows) == ROWS
        for row in rows.values():
            assert row["round_trip_exact"]
            assert row["encode_s"] > 0 and row["decode_s"] > 0
            assert row["bits_per_param"] == 8 * row["bytes"] / inp["params"]
        assert rows["dense fp32"]["bits_per_param"] >= 32 and rows["dense fp32"]["bits_per_param"] < 32.1
        assert 16 <= rows["dense bf16"]["bits_per_param"] < 16.1
        assert rows["dense fp32"]["rel_err_vs_delta"] == 0 and rows["zstd-3 fp32"]["rel_err_vs_delta"] == 0
        k32, k64, k128 = (rows[f"sparseloco k={k} entropy"] for k in (32, 64, 128))
        # more kept values cost more bytes and leave less of the EF buffer behind
        assert k32["bytes"] < k64["bytes"] < k128["bytes"]
        assert k32["rel_err_vs_e"] > k64["rel_err_vs_e"] > k128["rel_err_vs_e"]
        assert rows["sparseloco k=64 packed12"]["rel_err_vs_e"] == k64["rel_err_vs_e"]  # same message, other bytes
    real = inputs["tiny"]["rows"]
    assert real["sparseloco k=64 entropy"]["bits_per_param"] <= 0.16
    assert real["sparseloco k=64 packed12"]["bits_per_param"] <= 0.23
    assert real["dense fp32"]["ratio_vs_fp32"] == 1.0
    assert real["sparseloco k=64 entropy"]["ratio_vs_fp32"] > 200
