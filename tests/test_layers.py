"""The package's shape, read from its imports: every module imports on its own, no two files import
each other (directly or round a loop, lazy imports inside functions included), and no module of a
lower layer imports a higher one.

    errors < text < model < core < {engines, voice, offline} < server < server.http < cli

The three packages of one rank are siblings: none imports another. The service (`shadow.server`)
knows nothing of HTTP: only `shadow.server.http` and the CLI import it. In `shadow/cli/`, a command
imports only `shadow.cli.common` of the CLI (no command imports another's helpers).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = [("shadow", "shadow.errors"), ("shadow.text",), ("shadow.model",), ("shadow.core",),
          ("shadow.engines", "shadow.voice", "shadow.offline"), ("shadow.server",),
          ("shadow.server.http",), ("shadow.cli",)]


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.glob("shadow/**/*.py")):
        name = ".".join(path.with_suffix("").relative_to(ROOT).parts)
        out[name.removesuffix(".__init__")] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project's modules `name` imports anywhere in its file (a `from pkg import sub` of a
    submodule counts as that submodule)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.add(sub if sub in known else node.module)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return {m for m in out if m in known and m != name}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def rank(name: str) -> tuple[int, str]:
    """(the layer's rank, the package it belongs to) for a module."""
    best = None
    for r, packages in enumerate(LAYERS):
        for package in packages:
            if (name == package or name.startswith(package + ".")) and (best is None or len(package) > len(best[1])):
                best = (r, package)
    assert best is not None, f"{name} is in no layer"
    return best


@pytest.mark.slow
def test_every_module_imports_on_its_own():
    """In a fresh interpreter, each module is imported with no other module of the project loaded
    (the project's modules are dropped from sys.modules before each), so an import that works only
    after another module was imported first fails here."""
    names = sorted(modules())
    script = (
        "import importlib, sys, traceback\n"
        f"failed = []\n"
        f"for name in {names!r}:\n"
        "    for loaded in [m for m in sys.modules if m == 'shadow' or m.startswith('shadow.')]:\n"
        "        del sys.modules[loaded]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as e:\n"
        "        failed.append(f'{name}: {type(e).__name__}: {e}')\n"
        "print('\\n'.join(failed))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "", done.stdout


def test_no_import_cycle_between_files():
    g = graph()
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                cycles.append(sorted(part))

    for v in sorted(g):
        if v not in index:
            visit(v)
    assert cycles == []


def test_no_lower_layer_imports_a_higher_one():
    wrong = []
    for name, deps in sorted(graph().items()):
        mine, my_package = rank(name)
        for dep in sorted(deps):
            theirs, their_package = rank(dep)
            if theirs > mine or (theirs == mine and their_package != my_package):
                wrong.append(f"{name} -> {dep}")
    assert wrong == []


def test_no_command_imports_another():
    g = graph()
    wrong = [f"{name} -> {dep}" for name, deps in g.items() if name.startswith("shadow.cli.")
             and name != "shadow.cli.main" for dep in deps if dep.startswith("shadow.cli.") and dep != "shadow.cli.common"]
    assert wrong == []


def test_the_layer_picture_in_the_docs_is_the_codes():
    done = subprocess.run([sys.executable, "experiments/architecture.py", "--check"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
