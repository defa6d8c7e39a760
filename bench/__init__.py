"""Benchmarks: scripts that print figures (never tests)."""
