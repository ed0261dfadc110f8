"""The trained model outside hlbp: a checkpoint's parameters as a Hugging Face Llama folder.

A full replica writes, beside its checkpoint, what the checkpoint alone does not say: the model's shape
(:data:`MODEL_FILE`, the :class:`~hlbp.peer.model.decoder.ModelConfig` the run trains) and the run's tokenizer
(:data:`TOKENIZER_FILE`). With those three files a checkpoint directory is self-contained: :func:`export_hf` turns it
into a folder that ``transformers`` loads with ``AutoModelForCausalLM`` and ``AutoTokenizer``, and
:mod:`hlbp.peer.train.sample` samples from it without a manifest or a network.

The plain decoder is a Llama exactly: pre-norm RMSNorm blocks with a weight, rotary embeddings that rotate the two
halves of each head (Llama's ``rotate_half``), SwiGLU feed-forward, no biases, an untied head. The subspace network
of the variants A is not: its constrained blocks normalise their outputs with a fixed gain, which Llama has no
place for, so its export is refused with one line rather than written as a different model.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from hlbp.peer.common.errors import UserInputError
from hlbp.peer.common.files import atomic_write_bytes
from hlbp.peer.model.decoder import ModelConfig

MODEL_FILE = "model.json"  # beside a checkpoint: the model's shape, the run and the end-of-text token
TOKENIZER_FILE = "tokenizer.json"  # beside a checkpoint: the run's tokenizer (a `tokenizers` JSON file)
CHECKPOINT_FILE = "checkpoint.safetensors"
# where a checkpoint keeps the model's parameters: a replica's global ones (the anchor, hlbp.peer.rounds.persist),
# the model of `hlbp train` (hlbp.peer.train.trainer), or a NoLoCo replica's outer weights
# (hlbp.peer.rounds.noloco_loop)
PREFIXES = ("anchor.", "model.", "phi.")
MAX_MODEL_FILE = 64 * 1024


class ExportRefused(UserInputError):
    """The model cannot be written in the asked format without changing what it computes."""


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What a checkpoint directory says about its model, besides the parameters."""

    run_id: str
    config: ModelConfig
    eot_id: int
    tokens_per_step: int = 0  # tokens in one inner step of this peer (0: not known)

    def to_json(self) -> bytes:
        return json.dumps({"run": self.run_id, "eot_id": self.eot_id, "tokens_per_step": self.tokens_per_step,
                           "model": dataclasses.asdict(self.config)}, indent=1, sort_keys=True).encode()


def write_model_info(directory: Path, info: ModelInfo, tokenizer_path: Path) -> None:
    """Write :data:`MODEL_FILE` and a copy of the tokenizer into ``directory`` (a replica's output directory)."""
    directory.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(directory / MODEL_FILE, info.to_json())
    if Path(tokenizer_path).resolve() != (directory / TOKENIZER_FILE).resolve():
        atomic_write_bytes(directory / TOKENIZER_FILE, Path(tokenizer_path).read_bytes())


def read_model_info(directory: Path) -> ModelInfo:
    """:data:`MODEL_FILE` of ``directory``, checked; :class:`UserInputError` (one line) when missing or malformed."""
    path = Path(directory) / MODEL_FILE
    if not path.is_file():
        raise UserInputError(f"{path} is missing: the model's shape is written there by `hlbp join` (a full replica)"
                             " beside its checkpoint; a checkpoint from an older hlbp has none")
    if path.stat().st_size > MAX_MODEL_FILE:
        raise UserInputError(f"{path} is over {MAX_MODEL_FILE} bytes: not a model description")
    try:
        raw = json.loads(path.read_text())
        fields = {f.name for f in dataclasses.fields(ModelConfig)}
        model = raw["model"]
        if not isinstance(model, dict) or set(model) - set(fields):
            raise ValueError(f"unknown fields {sorted(set(model) - set(fields))[:5]}")
        config = ModelConfig(**model)
        run_id, eot_id, per_step = raw["run"], raw["eot_id"], raw.get("tokens_per_step", 0)
        if not isinstance(run_id, str) or not isinstance(eot_id, int) or not 0 <= eot_id < config.vocab_size \
                or not isinstance(per_step, int) or per_step < 0:
            raise ValueError("run, eot_id or tokens_per_step malformed")
    except (ValueError, KeyError, TypeError) as exc:
        raise UserInputError(f"{path} is not a model description hlbp wrote ({exc})") from None
    return ModelInfo(run_id, config, eot_id, per_step)


STAGE_ROUNDS_FILE = "rounds.safetensors"  # a stage peer's round state: the anchor of its stage's shard
MAX_DEPTH = 4  # how deep under a run directory peers' directories are looked for (simulate: name/run/peer)


def _peer_dirs(root: Path, name: str) -> list[Path]:
    """The directories under ``root`` (``root`` included, at most MAX_DEPTH down) holding ``name`` and
    :data:`MODEL_FILE`."""
    found = []
    for depth in range(MAX_DEPTH + 1):
        found += [p.parent for p in sorted(root.glob("/".join(["*"] * depth + [name])))
                  if (p.parent / MODEL_FILE).is_file()]
    return found


def _round_of(header: Mapping[str, Any]) -> int:
    r = header.get("round")
    return r if isinstance(r, int) and not isinstance(r, bool) else -1


def _shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The parameter shapes of ``config``'s decoder, built on the meta device: a model.json naming a huge model
    allocates nothing here. (The subspace basis is a buffer, not a parameter: the shapes are the plain model's.)"""
    from hlbp.peer.model.decoder import build_model

    with torch.device("meta"):
        model = build_model(config.replace(subspace_rank=0))
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def _checked(info: ModelInfo, params: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    want = _shapes(info.config)
    got = {n: tuple(t.shape) for n, t in params.items()}
    if got != want:
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        wrong = sorted(n for n in set(want) & set(got) if want[n] != got[n])
        raise UserInputError(f"{where} does not hold the parameters its {MODEL_FILE} describes (missing "
                             f"{missing[:3]}, unexpected {extra[:3]}, other shapes {wrong[:3]})")
    return params


@dataclasses.dataclass(frozen=True)
class Loaded:
    """A trained model as :func:`load_parameters` found it: its description, parameters and checkpoint header, and
    the directory whose :data:`TOKENIZER_FILE` goes with it."""

    info: ModelInfo
    params: dict[str, torch.Tensor]
    header: dict[str, Any]
    directory: Path


def _from_checkpoint(file: Path) -> Loaded:
    from hlbp.peer.train.checkpoint import load_checkpoint

    info = read_model_info(file.parent)
    tensors, header = load_checkpoint(file)
    prefix = next((p for p in PREFIXES if any(k.startswith(p) for k in tensors)), "")
    params = {k[len(prefix):]: v for k, v in tensors.items() if prefix and k.startswith(prefix)}
    return Loaded(info, _checked(info, params, str(file)), header, file.parent)


def _from_stages(root: Path, stages: list[Path]) -> Loaded:
    """The global model assembled from the stage peers' directories ``stages`` under ``root``: each stage peer's
    round state holds the anchor of its stage's shard; the latest round whose shards together make the whole model
    wins."""
    from hlbp.peer.train.checkpoint import load_checkpoint

    by_round: dict[int, dict[str, torch.Tensor]] = {}
    infos = [read_model_info(d) for d in stages]
    if len({(i.run_id, i.config) for i in infos}) != 1:
        raise UserInputError(f"the stage peers under {root} are of different runs or models: export one run's")
    for d in stages:
        tensors, header = load_checkpoint(d / STAGE_ROUNDS_FILE)
        shard = {k[len(PREFIXES[0]):]: v for k, v in tensors.items() if k.startswith(PREFIXES[0])}
        by_round.setdefault(_round_of(header), {}).update(shard)
    names = set(_shapes(infos[0].config))
    whole = [r for r, params in by_round.items() if set(params) >= names]
    if not whole:
        raise UserInputError(f"the stage peers under {root} do not hold every stage of one round: the model "
                             "cannot be assembled from them")
    r = max(whole)
    params = {n: by_round[r][n] for n in names}
    return Loaded(infos[0], _checked(infos[0], params, f"the stage peers under {root}"), {"round": r}, stages[0])


def load_parameters(path: Path) -> Loaded:
    """The trained model at ``path``: a replica's checkpoint (file or directory; its anchor is the global model the
    run agreed on; ``hlbp train``'s model), or a run directory: its replica checkpoint of the latest round, else the
    model assembled from its stage peers' shards."""
    from hlbp.peer.train.checkpoint import checkpoint_header

    path = Path(path)
    if path.is_file():
        return _from_checkpoint(path)
    if (path / CHECKPOINT_FILE).is_file():
        return _from_checkpoint(path / CHECKPOINT_FILE)
    replicas = _peer_dirs(path, CHECKPOINT_FILE) if path.is_dir() else []
    if replicas:
        newest = max(replicas, key=lambda d: (_round_of(checkpoint_header(d / CHECKPOINT_FILE)), str(d)))
        return _from_checkpoint(newest / CHECKPOINT_FILE)
    stages = _peer_dirs(path, STAGE_ROUNDS_FILE) if path.is_dir() else []
    if stages:
        return _from_stages(path, stages)
    raise UserInputError(f"no model at or under {path}: give a replica's checkpoint.safetensors, its directory, or "
                         "a run directory that holds replicas' or stage peers' directories")


def llama_config(info: ModelInfo) -> dict[str, Any]:
    """The ``config.json`` of a ``LlamaForCausalLM`` that computes what hlbp's decoder does."""
    c = info.config
    if c.subspace_rank:
        raise ExportRefused(f"this run trains the subspace network (subspace_rank={c.subspace_rank}): its "
                            "constrained blocks normalise their outputs with a fixed gain, which a Llama model has "
                            "no place for, so it cannot be exported as one; sample from it with `hlbp generate`")
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": c.vocab_size, "hidden_size": c.d_model, "intermediate_size": c.d_ff,
        "num_hidden_layers": c.n_layers, "num_attention_heads": c.n_heads, "num_key_value_heads": c.n_heads,
        "head_dim": c.head_dim, "max_position_embeddings": c.max_seq_len, "rms_norm_eps": c.norm_eps,
        "rope_theta": c.rope_theta, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": False, "initializer_range": c.init_std, "torch_dtype": "float32",
        "bos_token_id": info.eot_id, "eos_token_id": info.eot_id, "pad_token_id": info.eot_id,
    }


_BLOCK_NAMES = {
    "attn.wq.weight": "self_attn.q_proj.weight", "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight", "attn.wo.weight": "self_attn.o_proj.weight",
    "ffn.w1.weight": "mlp.gate_proj.weight", "ffn.w3.weight": "mlp.up_proj.weight",
    "ffn.w2.weight": "mlp.down_proj.weight", "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_NAMES = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
              "head.weight": "lm_head.weight"}


def llama_state_dict(params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """hlbp's parameter names as Llama's (the same tensors: both lay a linear layer out as [out, in])."""
    out: dict[str, torch.Tensor] = {}
    for name, t in params.items():
        if name in _TOP_NAMES:
            out[_TOP_NAMES[name]] = t
            continue
        _, index, rest = name.split(".", 2)  # blocks.<i>.<rest>
        if rest not in _BLOCK_NAMES:
            raise ExportRefused(f"parameter {name} has no counterpart in a Llama model")
        out[f"model.layers.{index}.{_BLOCK_NAMES[rest]}"] = t
    return {k: v.detach().float().contiguous().clone() for k, v in out.items()}


def _card(info: ModelInfo, header: Mapping[str, Any], val_loss: float | None, steps: int) -> str:
    c = info.config
    loss = f"{val_loss:.4f}" if val_loss is not None and math.isfinite(val_loss) else "not recorded"
    tokens = f"{steps * info.tokens_per_step:,}" if steps and info.tokens_per_step else "not recorded"
    return (f"# {info.run_id}\n\nA decoder pre-trained by volunteer peers with hlbp, run `{info.run_id}`, exported "
            f"from a full replica's checkpoint after round {header.get('round', '?')}.\n\n"
            f"- shape: {c.n_layers} layers, width {c.d_model}, {c.n_heads} heads, feed-forward {c.d_ff}, "
            f"context {c.max_seq_len}, vocabulary {c.vocab_size}\n"
            f"- validation loss at the last recorded round: {loss}\n"
            f"- tokens this replica trained on (its own inner steps; each round merges every contributor's): "
            f"{tokens}\n\n"
            "Load it with `AutoModelForCausalLM.from_pretrained(dir)` and `AutoTokenizer.from_pretrained(dir)`.\n")


def recorded(directory: Path) -> tuple[float | None, int]:
    """From a replica's ``metrics.jsonl`` in ``directory``: the validation loss of the last round that recorded one
    (None if none did) and the inner steps of its rounds, summed."""
    path = Path(directory) / "metrics.jsonl"
    if not path.is_file():
        return None, 0
    loss, steps = None, 0
    for line in path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict) or rec.get("event") != "round":
            continue
        if isinstance(rec.get("val_loss"), float):
            loss = rec["val_loss"]
        if isinstance(rec.get("steps"), int) and rec["steps"] > 0:
            steps += rec["steps"]
    return loss, steps


def export_hf(checkpoint: Path, out_dir: Path) -> Path:
    """Write ``out_dir``: ``config.json``, ``model.safetensors``, the tokenizer and a model card, from a replica's
    checkpoint (file or directory). Returns ``out_dir``; :class:`UserInputError` (one line) when it cannot."""
    from safetensors.torch import save_file

    loaded = load_parameters(checkpoint)
    info, params, header, directory = loaded.info, loaded.params, loaded.header, loaded.directory
    config = llama_config(info)
    tokenizer = directory / TOKENIZER_FILE
    if not tokenizer.is_file():
        raise UserInputError(f"{tokenizer} is missing: `hlbp join` writes the run's tokenizer beside its checkpoint")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(llama_state_dict(params), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
    (out_dir / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": info.eot_id, "eos_token_id": info.eot_id, "pad_token_id": info.eot_id}, indent=1))
    shutil.copyfile(tokenizer, out_dir / "tokenizer.json")
    eot = _token_text(tokenizer, info.eot_id)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": info.config.max_seq_len,
         "bos_token": eot, "eos_token": eot, "pad_token": eot, "add_bos_token": False, "add_eos_token": False},
        indent=1))
    (out_dir / "README.md").write_text(_card(info, header, *recorded(directory)))
    return out_dir


def _token_text(tokenizer: Path, token_id: int) -> str:
    from tokenizers import Tokenizer

    text = Tokenizer.from_file(str(tokenizer)).id_to_token(token_id)
    if text is None:
        raise UserInputError(f"{tokenizer} has no token {token_id}, the run's end-of-text token")
    return text
