"""hlbp.cli: the typer application behind the `hlbp` command."""
