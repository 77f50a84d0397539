"""Loads the request tracer (hop_tracer.py) into a service process that tests/e2e/test_request_hops.py
starts with this folder on PYTHONPATH and TINKERD_HOP_TRACE set; any other process is untouched."""

import os

if os.environ.get("TINKERD_HOP_TRACE"):
    import hop_tracer

    hop_tracer.install(os.environ["TINKERD_HOP_TRACE"])
