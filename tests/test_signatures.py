"""The library's calls read as sentences: no function in `shadow/` outside the kernels takes more
than six positional parameters (`self` and `cls` not counted); past that they are keyword-only, so
a call names what it passes and no flag travels as a bare `True`."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MOST = 6


def too_many_positional() -> list[str]:
    out = []
    for path in sorted((ROOT / "shadow").rglob("*.py")):
        if "kernels" in path.relative_to(ROOT).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names = [a.arg for a in node.args.posonlyargs + node.args.args if a.arg not in ("self", "cls")]
                if len(names) > MOST:
                    out.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({len(names)} positional)")
    return out


def test_no_function_takes_more_than_six_positional_parameters():
    assert too_many_positional() == []
