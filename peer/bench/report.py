"""Shared output of every benchmark: a rich table on the console and a JSON file with the full result."""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from hlbp.peer.common.files import atomic_write_bytes


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on, stored beside them."""
    import os

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    return info


def print_table(console: Console, title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A compact table; floats are shown with 4 significant digits."""
    table = Table(title=title, title_justify="left")
    for c in columns:
        table.add_column(c, justify="right" if c != columns[0] else "left")
    for row in rows:
        table.add_row(*(f"{v:.4g}" if isinstance(v, float) else str(v) for v in row))
    console.print(table)


def write_result(path: Path | None, name: str, config: dict[str, Any], result: Any) -> dict[str, Any]:
    """Wrap a result with its benchmark name, config and machine, and write it atomically when a path is given."""
    doc = {"benchmark": name, "config": config, "machine": machine_info(), "result": result}
    if path is not None:
        atomic_write_bytes(Path(path), json.dumps(doc, indent=2, default=str).encode())
    return doc


def finish_loss_plot(fig: Any, whole: Any, half: Any, title: str, path: Path, legend_size: int = 8) -> None:
    """Label a two-panel plot of validation loss against tokens (the whole run, and its second half), save it to
    ``path`` and close it: the convergence and gather benchmarks draw their curves, this finishes them alike."""
    import matplotlib.pyplot as plt

    for ax, t in ((whole, title), (half, "second half")):
        ax.set_xlabel("tokens (millions, all replicas)")
        ax.set_ylabel("validation loss")
        ax.set_title(t, fontsize=9)
    half.legend(fontsize=legend_size)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
