"""Text from a trained model: hlbp's own decoder, loaded from a replica's checkpoint directory, sampled token by
token (``hlbp generate``).

No manifest and no network: the directory's :data:`~hlbp.peer.train.export.MODEL_FILE` gives the shape and its
tokenizer the text. The whole context is re-run for each new token (the models hlbp trains on volunteer machines
are small enough that a key/value cache would buy little here); the context keeps the last ``max_seq_len`` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from hlbp.peer.common.errors import UserInputError
from hlbp.peer.model.decoder import Stage, build_model
from hlbp.peer.train.export import TOKENIZER_FILE, Loaded, load_parameters


@dataclass(frozen=True)
class Sampling:
    """How to pick each next token: ``temperature`` 0 is greedy (the most likely token, no randomness); otherwise
    from the softmax at that temperature over the ``top_k`` most likely tokens (0: all)."""

    max_tokens: int = 64
    temperature: float = 0.8
    top_k: int = 50
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_tokens < 0 or self.top_k < 0 or not self.temperature >= 0:
            raise UserInputError("--max-tokens and --top-k must be >= 0, --temperature a number >= 0")


def load_model(checkpoint: Path, device: torch.device) -> tuple[Loaded, Stage]:
    """The decoder at ``checkpoint`` (:func:`~hlbp.peer.train.export.load_parameters`), on ``device``, in eval
    mode, with what was loaded."""
    loaded = load_parameters(checkpoint)
    model = build_model(loaded.info.config)
    model.load_state_dict(loaded.params)
    return loaded, model.to(device).eval()


@torch.no_grad()
def generate(model: Stage, prompt: list[int], how: Sampling, eot_id: int | None = None) -> list[int]:
    """The tokens that follow ``prompt`` (at least one token), up to ``how.max_tokens`` or the end-of-text token."""
    if not prompt:
        raise UserInputError("the prompt is empty: give at least one token of text")
    device = next(model.parameters()).device
    gen = torch.Generator(device="cpu").manual_seed(how.seed)
    ids, out = list(prompt), []
    for _ in range(how.max_tokens):
        context = torch.tensor([ids[-model.config.max_seq_len:]], device=device)
        logits = model(context)[0, -1].float().cpu()
        if how.temperature == 0:
            token = int(logits.argmax())
        else:
            if how.top_k:
                cut = torch.topk(logits, min(how.top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < cut, float("-inf"))
            token = int(torch.multinomial(torch.softmax(logits / how.temperature, -1), 1, generator=gen))
        if token == eot_id:
            break
        ids.append(token)
        out.append(token)
    return out


def generate_text(checkpoint: Path, prompt: str, how: Sampling, device: torch.device) -> str:
    """``prompt`` continued by the model of a replica's checkpoint, with the run's tokenizer."""
    from tokenizers import Tokenizer

    loaded, model = load_model(checkpoint, device)
    tokenizer_path = loaded.directory / TOKENIZER_FILE
    if not tokenizer_path.is_file():
        raise UserInputError(f"{tokenizer_path} is missing: `hlbp join` writes the run's tokenizer beside its "
                             "checkpoint")
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    ids = tokenizer.encode(prompt).ids
    return tokenizer.decode(generate(model, ids, how, loaded.info.eot_id))
