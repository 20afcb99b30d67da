"""Shared fixtures: one random tiny checkpoint per test session, in a private cache folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
TRAJECTORIES = SHARED_DATA / "trajectories"


@pytest.fixture(scope="session", autouse=True)
def shadow_cache(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("shadow-cache")
    os.environ["SHADOW_CACHE"] = str(folder)
    return folder


@pytest.fixture(scope="session")
def tiny(shadow_cache):
    from shadow.model import load_model

    return load_model("tiny")


@pytest.fixture(scope="session")
def tokenizer():
    from shadow.tokenizer import load_tokenizer

    return load_tokenizer(None)


def shared_file(*parts: str) -> Path:
    path = SHARED_DATA.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"shared data not found at {path}")
    return path
