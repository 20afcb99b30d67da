"""The `shadow` command line: thin Typer commands that call the library and render its results."""
