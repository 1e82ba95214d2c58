"""Prometheus gauges for the engine's stats, when `prometheus-client` is installed.

One gauge per numeric stat, `paged_backend_<key>`, labelled `model` and `replica`: an engine as a
whole (a local engine; a Ray engine's totals over its replicas) has `replica=""`, and each
replica of a Ray engine its index, so `{replica=""}` selects engine totals in both backends and
`{replica!=""}` the replicas. Prometheus client libraries allow one label set per metric name,
hence `replica` on every gauge."""

from __future__ import annotations

import threading

try:
    import prometheus_client
except ImportError:  # optional dependency
    prometheus_client = None

ENABLED = prometheus_client is not None
_lock = threading.Lock()
_gauges: dict[str, object] = {}
_exported: dict[tuple[str, str], set[str]] = {}  # stat keys set per (model, replica)


def export(stats: dict, model_name: str, replica: str = "") -> bool:
    """Set the gauges of `stats`' numeric values for (model, replica), and remove that label
    set from gauges whose stat is now missing (a dead replica reports only `alive`), so that no
    stale value is scraped. Returns whether prometheus-client is available."""
    if prometheus_client is None:
        return False
    numeric = {k: v for k, v in stats.items() if isinstance(v, int | float)}
    with _lock:
        for key, value in numeric.items():
            gauge = _gauges.get(key)
            if gauge is None:
                gauge = prometheus_client.Gauge(
                    f"paged_backend_{key}",
                    f"paged-backend engine stat {key}",
                    ["model", "replica"],
                )
                _gauges[key] = gauge
            gauge.labels(model=model_name, replica=replica).set(value)
        labels = (model_name, replica)
        for key in _exported.get(labels, set()) - numeric.keys():
            _gauges[key].remove(*labels)
        _exported[labels] = set(numeric)
    return True
