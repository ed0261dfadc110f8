"""Option helpers: every flag of every command can also be set from an ``HLBP_*`` environment variable."""

from __future__ import annotations

from typing import Any

import typer


def opt(default: Any, *flags: str, env: str, help: str, **kwargs: Any) -> Any:
    """A typer option that also reads ``HLBP_<env>`` and shows that variable in ``--help``."""
    return typer.Option(default, *flags, envvar=f"HLBP_{env}", show_envvar=True, help=help, **kwargs)
