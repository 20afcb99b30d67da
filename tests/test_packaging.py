"""What a wheel of the project carries: every package-data glob in pyproject.toml names files that
exist under its package, so an install that is not editable keeps them (the GPU pins among them)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_data_glob_matches_files_of_its_package():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = config["tool"]["setuptools"]["package-data"]
    assert globs, "no package data declared"
    for package, patterns in globs.items():
        folder = ROOT.joinpath(*package.split("."))
        assert (folder / "__init__.py").is_file(), f"{package}: not a package of this project"
        for pattern in patterns:
            assert list(folder.glob(pattern)), f"{package}: {pattern} matches no file"


def test_the_h200_autotune_pins_ship_with_the_package():
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    pins = ROOT / "shadow/model/kernels/pins/NVIDIA_H200.json"
    assert pins.is_file()
    assert any(pins in ROOT.joinpath(*p.split(".")).glob(g) for p, gs in globs.items() for g in gs)
