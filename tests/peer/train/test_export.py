"""A trained model outside hlbp: ``hlbp train`` (a real process, the tiny preset for 30 steps on the builtin
corpus) writes a checkpoint directory; ``hlbp export`` turns it into a Hugging Face folder that ``transformers``
loads; its logits equal hlbp's within 1e-4 (fp32), its tokenizer encodes as the run's, and ``hlbp generate
--temperature 0`` prints the tokens ``transformers``' greedy ``generate`` picks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

HLBP = (sys.executable, "-m", "hlbp.cli.main")
PROMPT = "The history of the"


def _hlbp(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*HLBP, *args], check=False, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("trained")
    subprocess.run([*HLBP, "train", "--steps", "30", "--batch-size", "4", "--seq-len", "64", "--eval-every", "30",
                    "--eval-batches", "1", "--threads", "1", "--device", "cpu", "--no-progress", "--out-dir",
                    str(out), "--cache-dir", str(cache_dir)], check=True, capture_output=True, text=True, timeout=600)
    return out


@pytest.fixture(scope="module")
def exported(trained: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hf")
    done = _hlbp("export", str(trained), str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md"} <= \
        {p.name for p in out.iterdir()}
    return out


def test_transformers_computes_the_same_logits(trained: Path, exported: Path) -> None:
    from hlbp.peer.train.sample import load_model

    _, ours = load_model(trained, torch.device("cpu"))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(exported, torch_dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, ours.config.vocab_size, (2, ours.config.max_seq_len), generator=gen)
    with torch.no_grad():
        diff = (ours(ids) - theirs(ids).logits).abs().max().item()
    assert diff < 1e-4, diff


def test_the_tokenizer_encodes_as_the_runs(trained: Path, exported: Path) -> None:
    from tokenizers import Tokenizer

    ours = Tokenizer.from_file(str(trained / "tokenizer.json"))
    theirs = transformers.AutoTokenizer.from_pretrained(exported)
    text = "Volunteers pre-train a model together, one round at a time."
    assert theirs(text).input_ids == ours.encode(text).ids
    assert theirs.eos_token_id == json.loads((trained / "model.json").read_text())["eot_id"]


def test_greedy_generation_matches_transformers(trained: Path, exported: Path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(exported)
    model = transformers.AutoModelForCausalLM.from_pretrained(exported, torch_dtype=torch.float32).eval()
    ids = torch.tensor([tok(PROMPT).input_ids])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.eos_token_id)
    expected = PROMPT + tok.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True)
    done = _hlbp("generate", str(trained / "checkpoint.safetensors"), "--prompt", PROMPT, "--max-tokens", "20",
                 "--temperature", "0", "--device", "cpu")
    assert done.returncode == 0, done.stderr
    assert done.stdout == expected + "\n"  # echo ends the text with one newline of its own
    assert len(done.stdout) > len(PROMPT)


def test_sampling_is_seeded_and_a_bad_directory_is_one_line(trained: Path, tmp_path: Path) -> None:
    args = ("generate", str(trained), "--prompt", PROMPT, "--max-tokens", "12", "--device", "cpu", "--seed", "3")
    first = _hlbp(*args)
    assert first.returncode == 0 and first.stdout.startswith(PROMPT) and first.stdout == _hlbp(*args).stdout
    (tmp_path / "checkpoint.safetensors").write_bytes(b"not a checkpoint")
    bad = _hlbp("export", str(tmp_path), str(tmp_path / "out"))
    assert bad.returncode == 2 and "model.json" in bad.stdout + bad.stderr
    assert len((bad.stdout + bad.stderr).strip().splitlines()) == 1, bad.stdout + bad.stderr


def test_the_subspace_network_is_refused_with_one_line(trained: Path, tmp_path: Path) -> None:
    from hlbp.peer.common.errors import UserInputError
    from hlbp.peer.train.export import ExportRefused, ModelInfo, llama_config, read_model_info

    info = read_model_info(trained)
    with pytest.raises(ExportRefused, match="subspace network"):
        llama_config(ModelInfo(info.run_id, info.config.replace(subspace_rank=8), info.eot_id))
    (tmp_path / "model.json").write_text(json.dumps({"run": "x", "eot_id": 0, "model": {"d_model": "wide"}}))
    with pytest.raises(UserInputError):
        read_model_info(tmp_path)


def _shard_names(rounds_file: Path) -> list[str]:
    """The parameter names of the shard a stage peer's round state holds (its ``anchor.`` tensors)."""
    from safetensors import safe_open

    with safe_open(str(rounds_file), "pt") as f:
        keys = f.keys()  # a safetensors handle is not iterable itself
    return [k[len("anchor."):] for k in keys if k.startswith("anchor.")]


def test_a_run_of_stage_peers_is_assembled_into_the_model_the_replicas_agreed_on(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """``hlbp simulate`` with a full replica and a 2-stage swarm (real processes); the stage peers' directories
    alone are exported: their shards together are the global model, checksum for checksum what the replica recorded
    for the same round."""
    import shutil

    from hlbp.peer.rounds.statesync import shard_checksum
    from hlbp.peer.train.export import load_parameters

    work = tmp_path_factory.mktemp("swarm-run")
    done = _hlbp("simulate", "--full", "1", "--swarms", "1", "--stages", "2", "--rounds", "2", "--workdir",
                 str(work / "run"), timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    stages_only = work / "stages"
    for d in (work / "run").glob("sw0s*"):
        if d.is_dir():
            shutil.copytree(d, stages_only / d.name)
    loaded = load_parameters(stages_only)
    params, header = loaded.params, loaded.header
    state_of = header["round"] - 1  # a round state names the next round to run
    records = [json.loads(line) for line in next((work / "run").glob("peer0/*/*/metrics.jsonl")).read_text()
               .splitlines()]
    want = next(r["checksums"] for r in records if r.get("event") == "round" and r["round"] == state_of)
    got = {str(i): shard_checksum(params, _shard_names(next(stages_only.glob(f"sw0s{i}/*/*/rounds.safetensors"))))
           for i in range(2)}  # each shard as its stage peer holds it: the manifest's split, whatever it is
    assert got == want
    out = work / "hf"
    assert _hlbp("export", str(stages_only), str(out)).returncode == 0
    assert transformers.AutoModelForCausalLM.from_pretrained(out) is not None


def test_a_model_json_naming_a_huge_model_is_refused_without_building_it(trained: Path, tmp_path: Path) -> None:
    """model.json is a file, so hostile: one naming a model of 10^12 parameters beside a small checkpoint is
    refused in one line, its shapes read on the meta device (nothing allocated)."""
    import shutil

    from hlbp.peer.common.errors import UserInputError
    from hlbp.peer.train.export import load_parameters

    shutil.copy(trained / "checkpoint.safetensors", tmp_path / "checkpoint.safetensors")
    info = json.loads((trained / "model.json").read_text())
    info["model"].update(d_model=1 << 16, n_heads=256, d_ff=1 << 18, n_layers=64)
    (tmp_path / "model.json").write_text(json.dumps(info))
    with pytest.raises(UserInputError, match="does not hold the parameters"):
        load_parameters(tmp_path)
