"""Errors a user can cause. The CLI prints their message and exits 2; serve answers 4xx."""


class ShadowInputError(ValueError):
    """Bad input (a preset, a path, a file, ids, a grid, choices). Raised before any state changes."""


class ShadowUnavailable(RuntimeError):
    """The shadow cannot answer yet (its model is still loading, or failed to load); serve answers 503."""


class ShadowNotExact(RuntimeError):
    """An ask on a session whose ids are not verified against the engine, with --require-exact; serve answers 409."""


def read_text(path, what: str = "file") -> str:
    """A text file the user named, as UTF-8; a ShadowInputError naming it when it cannot be read
    (missing, a folder, not text)."""
    from pathlib import Path

    path = Path(path)
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ShadowInputError(f"{path}: not a text {what} (not UTF-8)") from None
    except OSError as e:
        raise ShadowInputError(f"cannot read {what} {path}: {e.strerror or e}") from None
