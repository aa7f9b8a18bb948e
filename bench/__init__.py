"""Benchmarks. Run one with `python -m bench.<name>`, or all with `python -m bench`."""
