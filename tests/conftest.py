"""Shared fixtures: one random tiny checkpoint per test session, in a private cache folder."""

from __future__ import annotations

import os
from pathlib import Path

# one torch thread (and one OpenMP thread in every process the tests start): on a shared 2-core
# machine, torch's thread pool contending with itself made the suite 6x slower (19.5 against 3 min)
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import pytest  # noqa: E402

# the team's data (../shared/data beside the checkout, or SHADOW_SHARED_DATA): tests that need it skip without it
SHARED_DATA = Path(os.environ.get("SHADOW_SHARED_DATA") or Path(__file__).resolve().parents[1].parent / "shared" / "data")
TRAJECTORIES = SHARED_DATA / "trajectories"


@pytest.fixture(scope="session", autouse=True)
def one_thread() -> None:
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def shadow_cache(tmp_path_factory) -> Path:
    """The cache folder of the whole run ($SHADOW_CACHE, inherited by every process a test starts):
    the random checkpoints and the vocabulary, never the user's ~/.cache/shadow."""
    folder = tmp_path_factory.mktemp("shadow-cache")
    os.environ["SHADOW_CACHE"] = str(folder)
    return folder


@pytest.fixture(autouse=True)
def sessions_folder(tmp_path_factory, monkeypatch) -> Path:
    """Each test's own disk folder for `shadow serve` (SHADOW_SERVE_DISK, which serve reads for
    --disk): a serve started without --disk writes its sessions there, not into the run's shared
    cache folder, so no test restores another's sessions."""
    folder = tmp_path_factory.mktemp("sessions")
    monkeypatch.setenv("SHADOW_SERVE_DISK", str(folder))
    return folder


@pytest.fixture(scope="session")
def tiny(shadow_cache):
    from shadow.model import load_model

    return load_model("tiny")


@pytest.fixture(scope="session")
def tokenizer():
    from shadow.text.tokenizer import load_tokenizer

    return load_tokenizer(None)


def shared_file(*parts: str) -> Path:
    path = SHARED_DATA.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"shared data not found at {path}")
    return path


@pytest.fixture(scope="session")
def big_model(tmp_path_factory, shadow_cache) -> Path:
    """A random-weight big-model folder (tiny shape, text layout) with the real Qwen3.5 vocabulary
    and chat template, for the real engines."""
    from engines import qwen_template
    from shadow.engines.bigmodel import write_engine_folder

    return write_engine_folder(tmp_path_factory.mktemp("big") / "qwen3.5-tiny-big", qwen_template())


@pytest.fixture(scope="session")
def transformers_engine(big_model, tmp_path_factory):
    """`transformers serve` over `big_model` on loopback, for the whole test session: its /v1 URL."""
    from engines import transformers_serve

    with transformers_serve(big_model, tmp_path_factory.mktemp("logs") / "transformers-serve.log") as url:
        yield url
