"""The voice: short phrases from a fork of a session's exact state, their checks, and their replay over recorded sessions."""
