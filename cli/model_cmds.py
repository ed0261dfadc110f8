"""``hlbp export``, ``hlbp generate`` and ``hlbp report``: what a run trained and measured, used outside it
(:mod:`hlbp.peer.train.export`, :mod:`hlbp.peer.train.sample`, :mod:`hlbp.peer.sim.html_report`). A thin shell: flags (each also an ``HLBP_*`` variable) in, one line or the text
out; errors are one line and exit status 2."""

from __future__ import annotations

from pathlib import Path

import typer

from hlbp.cli.options import opt


def export(
    checkpoint: Path = typer.Argument(..., help="A replica's checkpoint.safetensors, or the directory that holds it."),
    out_dir: Path = typer.Argument(..., help="The folder to write (created if needed)."),
) -> None:
    """Write a trained model as a Hugging Face Llama folder: config.json, model.safetensors, the tokenizer and a
    model card, which AutoModelForCausalLM and AutoTokenizer load."""
    from hlbp.peer.train.export import export_hf

    out = export_hf(checkpoint, out_dir)
    typer.echo(f"exported to {out}: load it with AutoModelForCausalLM.from_pretrained({str(out)!r})")


def generate(
    checkpoint: Path = typer.Argument(..., help="A replica's checkpoint.safetensors, or the directory that holds it."),
    prompt: str = opt("The", "--prompt", env="PROMPT", help="Text to continue."),
    max_tokens: int = opt(64, "--max-tokens", env="MAX_TOKENS", help="Tokens to generate at most."),
    temperature: float = opt(0.8, "--temperature", env="TEMPERATURE", help="Softmax temperature; 0 is greedy."),
    top_k: int = opt(50, "--top-k", env="TOP_K", help="Sample among this many most likely tokens (0: all)."),
    seed: int = opt(0, "--seed", env="SEED", help="Seed of the sampling."),
    device: str = opt("auto", "--device", env="DEVICE", help="auto, cpu or cuda."),
) -> None:
    """Continue a prompt with a trained model (its checkpoint directory holds the model's shape and tokenizer)."""
    from hlbp.peer.train.sample import Sampling, generate_text
    from hlbp.peer.train.trainer import pick_device

    how = Sampling(max_tokens=max_tokens, temperature=temperature, top_k=top_k, seed=seed)
    typer.echo(prompt + generate_text(checkpoint, prompt, how, pick_device(device)))


def report(
    source: Path = typer.Argument(..., help="hlbp simulate's report JSON or work directory, or a replica's output "
                                  "directory (metrics.jsonl)."),
    out: Path | None = opt(None, "--out", env="REPORT_OUT", help="The HTML file to write (default: report.html "
                           "beside the source)."),
) -> None:
    """Draw a run's rounds as one self-contained HTML page: loss against tokens per role, bytes, utilization and
    accepted contributions per round, and the table of rounds."""
    from hlbp.peer.sim.html_report import write_report

    typer.echo(f"report written to {write_report(source, out)}")


def register(app: typer.Typer) -> None:
    """Add ``export``, ``generate`` and ``report`` to the ``hlbp`` app."""
    app.command()(export)
    app.command()(generate)
    app.command()(report)
