"""The docs say what the code does: every option they name exists, the environment variables they
promise are the CLI's, the defaults they state are the CLI's, and they speak of the project alone."""

from __future__ import annotations

import re
from pathlib import Path

import typer.main

from shadow.cli.main import app

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def commands() -> dict:
    group = typer.main.get_command(app)
    return {name: group.get_command(None, name) for name in group.list_commands(None)}


def is_option(p) -> bool:
    return getattr(p, "param_type_name", None) == "option"


def options(command) -> dict:
    out = {}
    for p in command.params:
        if is_option(p):
            for flag in [*p.opts, *p.secondary_opts]:
                out[flag] = p
    return out


def test_every_option_the_docs_name_exists():
    known = set()
    for command in commands().values():
        known |= set(options(command))
    known |= set(options(typer.main.get_command(app)))  # the app's own (--debug, --threads)
    for script in (ROOT / "experiments").glob("*.py"):  # the experiments' own options
        known |= set(re.findall(r"""add_argument\(\s*["'](--[a-z0-9-]+)""", script.read_text(encoding="utf-8")))
    missing = []
    for doc in DOCS:
        for flag in sorted(set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]+)", doc.read_text(encoding="utf-8")))):
            if flag not in known and flag not in ("--no-deps", "--index-url", "--upgrade", "--carry"):
                missing.append(f"{doc.name}: {flag}")
    # options of other programs the docs quote (pip, llama-server, vllm, ...) are named in code blocks
    # with their program; what is left must be this CLI's
    allowed = {"--index-url", "--local-dir", "--jinja", "--model-path", "--help", "--ctx-size", "--served-model-name",
               "--tool-call-parser", "--enable-auto-tool-choice", "--reasoning-parser", "--parallel", "--metrics",
               "--models-dir", "--gpu-memory-utilization", "--backend-sampling", "--reasoning-format",
               # retired experiments' own, quoted as the record of their runs: attention_variants.py's, and
               # restore_speed.py's before its format-2 arm was dropped
               "--variants", "--compare-whole-read"}
    assert [m for m in missing if m.split(": ")[1] not in allowed] == []


def test_serve_env_names_are_the_documented_ones():
    serve = commands()["serve"]
    keys = {"api_key": "SHADOW_API_KEY", "admin_key": "SHADOW_ADMIN_KEY", "upstream_api_key": "SHADOW_UPSTREAM_API_KEY",
            "store_key": "SHADOW_STORE_KEY"}
    text = (ROOT / "docs" / "SERVE.md").read_text(encoding="utf-8")
    for p in serve.params:
        if not is_option(p) or p.name == "config":
            continue
        want = keys.get(p.name, f"SHADOW_SERVE_{p.opts[0].removeprefix('--').replace('-', '_').upper()}")
        assert p.envvar == want, p.name
        if p.name in keys:
            assert f"`{want}`" in text  # the exceptions are named where the rule is stated


def test_prefix_matching_is_off_by_default_as_the_docs_say():
    serve = commands()["serve"]
    prefix = next(p for p in serve.params if p.name == "prefix_match")
    assert prefix.default is False
    text = (ROOT / "docs" / "SERVE.md").read_text(encoding="utf-8")
    assert "it is off by default" in text and "--no-prefix-match` change" not in text


def test_the_docs_speak_of_the_project_alone():
    """No work-session numbers, issues or design notes outside the project (results files aside)."""
    found = []
    for doc in DOCS:
        for k, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            if re.search(r"\bstop \d+\b|\bstop's\b|DESIGN(\.md)?\b|\bthe (serve|read-rate) issue\b|\.\./shared/seeds", line):
                found.append(f"{doc.name}:{k}: {line[:80]}")
    assert found == []
