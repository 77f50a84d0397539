"""Benchmarks: each figure is a ratio against the raw engine doing the same work in the same run.
Run them all with `python -m bench` (see bench/__main__.py)."""
