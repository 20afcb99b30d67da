"""`shadow`: the Typer app. Each command lives in its own module."""

import typer

from cli import ab, read_rate, replay_ledger, router_eval, serve, store, verify_exact

app = typer.Typer(
    help="Shadow reader toolkit: a small Qwen3.5 model that keeps an exact state of every session.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.command("verify-exact")(verify_exact.verify_exact)
app.command("read-rate")(read_rate.read_rate)
app.command("store")(store.store)
app.command("replay-ledger")(replay_ledger.replay_ledger)
app.command("serve")(serve.serve)
app.command("ab")(ab.ab)
app.command("router-eval")(router_eval.router_eval)


@app.callback()
def shadow() -> None:
    """Shadow reader toolkit: a small Qwen3.5 model that keeps an exact state of every session."""


def main() -> None:
    app()
