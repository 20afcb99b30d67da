"""Measurements: timers and the read-rate sweep. The CLI renders what these return."""
