"""Errors a user can cause. The CLI prints their message and exits 2; serve answers 4xx."""


class ShadowInputError(ValueError):
    """Bad input (a preset, a path, a file, ids, a grid, choices). Raised before any state changes."""


class ShadowUnavailable(RuntimeError):
    """The shadow cannot answer yet (its model is still loading, or failed to load); serve answers 503."""


class ShadowNotExact(RuntimeError):
    """An ask on a session whose ids are not verified against the engine, with --require-exact; serve answers 409."""
