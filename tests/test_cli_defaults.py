"""The CLI's defaults are the library's: every option generated from (or mapped to) a settings field
has the field's default, so no default is written twice. `shadow serve`'s options are the settings
tree's (`shadow.server.settings.options`); `shadow replay-ledger` shares serve's reading settings
(the same defaults) and takes its own from the replay's dataclasses."""

from __future__ import annotations

import dataclasses

import pytest
import typer.main

from shadow.cli.main import app
from shadow.core.schedule import BandwidthRule, Priorities
from shadow.offline.costs import CostTable
from shadow.offline.ledger import ServiceModel
from shadow.offline.limits import ReplayLimits
from shadow.offline.plan import Plan
from shadow.server.settings import ServeSettings, options, settings_from

SERVE_OWN = {"config", "read_rate_json"}  # serve's options that are no settings field (a file to read)


def command(name: str):
    return typer.main.get_command(app).get_command(None, name)


def params(name: str) -> dict:
    return {p.name: p for p in command(name).params}


def field_default(path: tuple[str, ...]):
    node = ServeSettings()
    for name in path:
        node = getattr(node, name)
    return node


def defaults_of(cls) -> dict:
    return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}


def test_every_serve_option_is_a_settings_field_with_its_default():
    got = params("serve")
    generated = {s.name: s for s in options()}
    assert set(got) - SERVE_OWN == set(generated)
    for name, s in generated.items():
        assert got[name].default == s.default, name
        assert s.field_value(got[name].default) == field_default(s.path), name  # back to the field: its default
    assert settings_from({name: got[name].default for name in generated}) == ServeSettings()


def test_serve_flags_are_the_settings_flags_and_bools_switch_both_ways():
    got = params("serve")
    for s in options():
        p = got[s.name]
        assert p.opts[0] == s.flag, s.name
        if s.type is bool:  # a --no-x flag is one way
            assert p.secondary_opts == ([] if s.flag.startswith("--no-") else ["--no-" + s.flag[2:]]), s.name


def test_replay_shares_serves_reading_settings_and_their_defaults():
    replay, serve = params("replay-ledger"), params("serve")
    # the replay's namesakes of serve's that are its own: --disk/--no-disk (spill or drop), --model (sizes only)
    shared = replay.keys() & {s.name for s in options()} - {"disk", "model"}
    assert shared == {"grid", "share", "slice_ms", "batch", "batch_ms", "batch_read_ms", "batch_wait_ms", "batch_busy",
                      "priorities", "cap_gib", "host_cap_gib", "restore_ahead", "prefix_cache", "prefix_cache_gib",
                      "voice_share", "predict", "read_ahead", "chat_template"}
    for name in shared:
        mine, theirs = replay[name].default, serve[name].default
        assert mine == theirs or list(mine) == [theirs], name  # a repeatable option: one arm, serve's default
        assert replay[name].opts == serve[name].opts and replay[name].help.startswith(serve[name].help), name
    assert [float(x) for x in replay["share"].default] == [BandwidthRule().share]
    assert replay["priorities"].default == [Priorities().label]
    # --disk/--no-disk: the replay spills where serve has a disk folder by default (its own, or --disk)
    assert replay["disk"].default is (serve["no_disk"].default is False) is True


@pytest.mark.parametrize("option, default", [
    ("restore_gib_s", defaults_of(CostTable)["restore_gib_s"]),
    ("spill_gib_s", defaults_of(CostTable)["spill_gib_s"]),
    ("host_gib_s", defaults_of(CostTable)["host_gib_s"]),
    ("ask_ms", defaults_of(CostTable)["ask_s"] * 1000),
    ("phrase_ms", defaults_of(CostTable)["phrase_s"] * 1000),
    ("tokenize_ms_per_1k", defaults_of(CostTable)["tokenize_s_per_1k"] * 1000),
    ("prefill_tok_s", ServiceModel().prefill_tok_s), ("decode_tok_s", ServiceModel().decode_tok_s),
    ("slots", ServiceModel().slots),
    ("label_ms", ReplayLimits().label_s * 1000), ("asks_per_hour", ReplayLimits().asks_per_hour),
    ("seed", ReplayLimits().seed),
    ("shared_prefix_tokens", ReplayLimits().shared_prefix_tokens),
    ("engines", defaults_of(Plan)["engines"]), ("route", defaults_of(Plan)["route"]),
    ("samples", defaults_of(Plan)["samples"]), ("window_s", defaults_of(Plan)["window_s"]),
    ("check_fleet", defaults_of(Plan)["check_fleet"]),
])
def test_the_replays_own_options_default_to_the_replays_dataclasses(option, default):
    assert params("replay-ledger")[option].default == pytest.approx(default)


def test_help_lists_every_option():
    from typer.testing import CliRunner

    for name in ("serve", "replay-ledger"):
        text = CliRunner().invoke(app, [name, "--help"], env={"COLUMNS": "400"}).output
        for p in command(name).params:
            if p.param_type_name == "option":
                assert p.opts[0] in text, (name, p.opts[0])
