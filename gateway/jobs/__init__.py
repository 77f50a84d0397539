"""Typed durable jobs: what a future runs, one class per request kind (base.py says how they
are stored; table.py lists them)."""
