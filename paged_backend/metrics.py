"""Prometheus gauges for the engine's stats, when `prometheus-client` is installed."""

from __future__ import annotations

import threading

try:
    import prometheus_client
except ImportError:  # optional dependency
    prometheus_client = None

_lock = threading.Lock()
_gauges: dict[str, object] = {}


def export(stats: dict, model_name: str) -> bool:
    """Set one gauge per numeric stat (`paged_backend_<key>`, labelled by model). Returns whether
    prometheus-client is available."""
    if prometheus_client is None:
        return False
    with _lock:
        for key, value in stats.items():
            if not isinstance(value, int | float):
                continue
            gauge = _gauges.get(key)
            if gauge is None:
                gauge = prometheus_client.Gauge(
                    f"paged_backend_{key}", f"paged-backend engine stat {key}", ["model"]
                )
                _gauges[key] = gauge
            gauge.labels(model=model_name).set(value)
    return True
