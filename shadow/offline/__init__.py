"""Offline work over recorded data: verify-exact's replay, ledgers and their replay through the read scheduler, the journal's format and router evaluation, benchmarks."""
