"""Option helpers: every flag of every command can also be set from an ``HLBP_*`` environment variable."""

from __future__ import annotations

import functools
import inspect
import sys
import typing
from collections.abc import Callable
from dataclasses import field, fields
from typing import Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

F = TypeVar("F")

# help texts that several commands share
INITIAL_PEERS_HELP = "Multiaddrs of running peers, with /p2p/<peer id> (the line `hlbp bootstrap` printed)."
ANNOUNCE_HELP = "Public multiaddrs others should dial (e.g. /ip4/<public IP>/tcp/PORT), when NAT hides ours."


def split_values(values: list[str] | None) -> list[str]:
    """Flags may repeat, and each value (or HLBP_* variable) may hold several addresses split by commas or spaces."""
    return [part for value in values or [] for part in value.replace(",", " ").split()]


def make_console(stderr: bool = True) -> Console:
    """A console for tables: the terminal's width, or 160 columns when output goes to a file or a pipe (rich would
    otherwise cut every table to 80 columns and truncate the numbers)."""
    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, width=None if stream.isatty() else 160)


def opt(default: Any, *flags: str, env: str, help: str, **kwargs: Any) -> Any:
    """A typer option that also reads ``HLBP_<env>`` and shows that variable in ``--help``."""
    return typer.Option(default, *flags, envvar=f"HLBP_{env}", show_envvar=True, help=help, **kwargs)


def flag(default: Any, *flags: str, env: str, help: str, **kwargs: Any) -> Any:
    """A field of a flags dataclass (see :func:`flags_command`): its default, and the typer option of :func:`opt`
    that sets it from the command line or ``HLBP_<env>``."""
    option = opt(default, *flags, env=env, help=help, **kwargs)
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"option": option})
    return field(default=default, metadata={"option": option})


def flags_command(flags: type[F]) -> Callable[[Callable[[F], None]], Callable[..., None]]:
    """Turn ``run(values: F)`` into a typer command whose flags are the fields of the dataclass ``F``.

    The flags are declared once, as fields made with :func:`flag`, and the dataclass is built (and so checks itself,
    in ``__post_init__``) in one place, here; the command function then gets a single value instead of a flag per
    argument. Its name and docstring become the command's name and help.
    """
    hints = typing.get_type_hints(flags)
    params = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.metadata["option"],
                                annotation=hints[f.name]) for f in fields(flags)]

    def decorate(run: Callable[[F], None]) -> Callable[..., None]:
        @functools.wraps(run)
        def command(**values: Any) -> None:
            run(flags(**values))

        command.__signature__ = inspect.Signature(params, return_annotation=None)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command

    return decorate


def parse_flags(flags: type[F], args: list[str], prog_name: str) -> F:
    """``args`` (and the ``HLBP_*`` variables) read as the flags of ``flags``, exactly as the command built by
    :func:`flags_command` reads them, for an entry point that runs the work itself; click's errors propagate."""
    parsed: list[F] = []
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command()(flags_command(flags)(parsed.append))
    typer.main.get_command(app).main(list(args), prog_name=prog_name, standalone_mode=False)
    if not parsed:
        raise typer.Exit(0)  # --help was asked for and printed
    return parsed[0]


def run_app(app: typer.Typer, console: Console) -> None:
    """Run a typer app; user and protocol errors become one line on stderr and exit status 2, never a traceback.
    Every hlbp process runs one malloc arena, set here before any thread starts
    (:func:`hlbp.peer.common.memory.limit_arenas`)."""
    from hlbp.peer.common import memory
    from hlbp.peer.common.errors import RunFailed, UserInputError
    from hlbp.protocol import ProtocolError

    memory.limit_arenas()
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
    except RunFailed as exc:  # a simulation's or a benchmark's peers failed: its outcome, with their output
        console.print(f"[bold red]error:[/] {escape(str(exc))}", soft_wrap=True)
        sys.exit(1)
