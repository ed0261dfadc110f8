"""Benchmarks behind `hlbp bench ...`: each returns a JSON-able result and prints a short table."""
