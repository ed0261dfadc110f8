"""Option helpers: every flag of every command can also be set from an ``HLBP_*`` environment variable."""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape


def make_console(stderr: bool = True) -> Console:
    """A console for tables: the terminal's width, or 160 columns when output goes to a file or a pipe (rich would
    otherwise cut every table to 80 columns and truncate the numbers)."""
    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, width=None if stream.isatty() else 160)


def opt(default: Any, *flags: str, env: str, help: str, **kwargs: Any) -> Any:
    """A typer option that also reads ``HLBP_<env>`` and shows that variable in ``--help``."""
    return typer.Option(default, *flags, envvar=f"HLBP_{env}", show_envvar=True, help=help, **kwargs)


def bind(command: Callable[..., Any], **fixed: Any) -> Callable[..., Any]:
    """``command`` with ``fixed`` keyword arguments bound and hidden from typer, which builds flags from the
    signature: what a caller passes in code (a test's fault hook) never becomes a command-line flag."""

    @functools.wraps(command)
    def bound(*args: Any, **kwargs: Any) -> Any:
        return command(*args, **kwargs, **fixed)

    sig = inspect.signature(command)
    bound.__signature__ = sig.replace(  # type: ignore[attr-defined]
        parameters=[p for name, p in sig.parameters.items() if name not in fixed])
    return bound


def run_app(app: typer.Typer, console: Console) -> None:
    """Run a typer app; user and protocol errors become one line on stderr and exit status 2, never a traceback."""
    from hlbp.peer.common.errors import UserInputError
    from hlbp.protocol import ProtocolError

    try:
        app()
    except (UserInputError, ProtocolError) as exc:
        # soft_wrap: a long message stays one line (addresses in it paste whole); its own newlines are kept
        console.print(f"[bold red]error:[/] {escape(str(exc))}", soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt:
        console.print("interrupted")
        sys.exit(130)
    except ConnectionError as exc:  # the node lost a part it cannot run without (its DHT process): say so, exit 1
        console.print(f"[bold red]error:[/] {exc}")
        sys.exit(1)
