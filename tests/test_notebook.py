"""The figures notebook runs on the committed results (its code cells, in order, headless)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import matplotlib

ROOT = Path(__file__).resolve().parents[1]


def test_figures_notebook_draws_every_figure():
    matplotlib.use("Agg")
    notebook = json.loads((ROOT / "notebooks" / "figures.ipynb").read_text())
    namespace: dict = {}
    cwd = os.getcwd()
    os.chdir(ROOT / "notebooks")
    try:
        for cell in notebook["cells"]:
            if cell["cell_type"] == "code":
                exec("".join(cell["source"]), namespace)
    finally:
        os.chdir(cwd)
    assert set(namespace["figures"]) == {"read-rate", "replay", "ab", "router-eval"}
    for fig in namespace["figures"].values():
        assert fig.axes and all(ax.has_data() for ax in fig.axes)
