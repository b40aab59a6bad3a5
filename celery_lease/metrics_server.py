"""Serving the metrics from a prefork worker (prometheus-client multiprocess mode)."""

from __future__ import annotations

import os
import tempfile

__all__ = ["prepare", "start"]


def prepare(port: int) -> None:
    """Before children fork: a multiprocess directory for their samples."""
    if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix=f"celery-lease-{port}-")


def start(port: int, addr: str = "127.0.0.1") -> None:
    """Listen on ``addr`` (``lease_metrics_addr``: loopback unless told otherwise)."""
    from prometheus_client import CollectorRegistry, multiprocess, start_http_server

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    start_http_server(port, addr=addr, registry=registry)
