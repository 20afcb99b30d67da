"""`shadow serve`: the live service (FastAPI), its embedded generator and the shadow beside it."""
