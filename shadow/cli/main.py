"""`shadow`: the Typer app. Each command lives in its own module."""

import os

import typer

from shadow.cli.common import ShadowGroup

from shadow.cli import ab, check_engine, doctor, read_rate, replay_ledger, router_eval, serve, store, verify_exact, voice_replay

app = typer.Typer(
    cls=ShadowGroup,
    help="Shadow reader toolkit: a small Qwen3.5 model that keeps an exact state of every session.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.command("verify-exact", short_help="Replay conversations turn by turn and check the state bit for bit against fresh prefills.")(verify_exact.verify_exact)
app.command("read-rate", short_help="Time the reader (per chunk, per 1,000 tokens, ask, fork decode) beside the transformers reference.")(read_rate.read_rate)
app.command("store", short_help="List and check a folder of spilled sessions.")(store.store)
app.command("replay-ledger", short_help="How fresh the shadow is at turn starts, replaying real request timelines.")(replay_ledger.replay_ledger)
app.command("serve", short_help="Serve OpenAI-compatible completions (embedded or in front of an engine) with a live shadow.")(serve.serve)
app.command("check-engine", short_help="Check, case by case, that a shadow beside an engine reads the ids the engine reads.")(check_engine.check_engine)
app.command("voice-replay", short_help="The voice on recorded sessions: phrase latency, what passes its checks, why not.")(voice_replay.voice_replay)
app.command("ab", short_help="What the shadow costs a running server's decode: shadow off against on.")(ab.ab)
app.command("doctor", short_help="Check the install, the device and its kernels, and exactness on it, in under a minute.")(doctor.doctor)
app.command("router-eval", short_help="Re-ask journaled classification questions offline and score them against their labels.")(router_eval.router_eval)


def default_threads(cores: int | None = None) -> int:
    """torch's CPU threads when none are asked for: one on a machine of two cores or fewer (torch's
    pool contending with itself on a small shared machine made every command several times slower),
    else half the cores, at most eight."""
    cores = cores or os.cpu_count() or 1
    return 1 if cores <= 2 else min(8, cores // 2)


@app.callback()
def shadow(ctx: typer.Context,
           debug: bool = typer.Option(False, "--debug", envvar="SHADOW_DEBUG",
                                      help="Show the traceback of an internal error (exit code 3)."),
           threads: int = typer.Option(0, "--threads", envvar="SHADOW_THREADS", min=0,
                                       help="torch's CPU threads (0: OMP_NUM_THREADS if set, else 1 on a machine of "
                                            "two cores or fewer and half the cores, at most 8, on a larger one).")) -> None:
    """Shadow reader toolkit: a small Qwen3.5 model that keeps an exact state of every session.
    Exit codes: 0 done, 1 the check failed (not bit-equal, gate failed, invalid files), 2 bad
    input (nothing changed), 3 an internal error (its traceback with --debug), 130 interrupted."""
    ctx.obj = {"debug": debug}
    n = str(threads) if threads else os.environ.get("OMP_NUM_THREADS") or str(default_threads())
    os.environ["OMP_NUM_THREADS"] = n  # read when torch starts (the commands import it after this)
    os.environ.setdefault("MKL_NUM_THREADS", n)
    import sys

    if "torch" in sys.modules:  # already started (in-process callers, tests): set it directly
        sys.modules["torch"].set_num_threads(int(n))


def main() -> None:
    app()
