"""What a wheel of the project carries: every package-data glob in pyproject.toml names files that
exist under its package, so an install that is not editable keeps them (the GPU pins among them)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

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


@pytest.mark.slow
def test_a_wheel_installs_no_top_level_package_but_shadow(tmp_path):
    """The wheel `pip install .` installs holds `shadow/` and its metadata only: the CLI is
    `shadow.cli`, never a top-level `cli` another distribution could also own."""
    import subprocess
    import sys
    import zipfile

    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    wheel, = tmp_path.glob("*.whl")
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"shadow"}
    entry = next(n for n in zipfile.ZipFile(wheel).namelist() if n.endswith("entry_points.txt"))
    assert "shadow = shadow.cli.main:main" in zipfile.ZipFile(wheel).read(entry).decode()
