"""Prometheus gauges for the engine's stats, when `prometheus-client` is installed.

One gauge per numeric stat, `paged_backend_<key>`, labelled `model`, `engine` and `replica`:
- `engine` is a process-unique id (`new_engine_id`: "0", "1", ... in creation order, also in
  `stats()["engine_id"]`), so that two engines of one model in a process export separate series
  instead of overwriting each other's;
- an engine as a whole (a local engine; a Ray engine's totals over its replicas) has
  `replica=""`, and each replica of a Ray engine its index, so `{replica=""}` selects engine
  totals in both backends and `{replica!=""}` the replicas.
Prometheus client libraries allow one label set per metric name, hence all three on every
gauge."""

from __future__ import annotations

import itertools
import threading

try:
    import prometheus_client
except ImportError:  # optional dependency
    prometheus_client = None

ENABLED = prometheus_client is not None
LABELS = ("model", "engine", "replica")
_lock = threading.Lock()
_gauges: dict[str, object] = {}
_exported: dict[tuple[str, str, str], set[str]] = {}  # stat keys set per label set
_engine_ids = itertools.count()


def new_engine_id() -> str:
    """The `engine` label of a new engine: unique in this process."""
    return str(next(_engine_ids))


def export(stats: dict, model_name: str, engine_id: str, replica: str = "") -> bool:
    """Set the gauges of `stats`' numeric values for (model, engine, replica), and remove that
    label set from gauges whose stat is now missing (a dead replica reports only `alive`), so
    that no stale value is scraped. Returns whether prometheus-client is available."""
    if prometheus_client is None:
        return False
    numeric = {k: v for k, v in stats.items() if isinstance(v, int | float)}
    labels = (model_name, engine_id, replica)
    with _lock:
        for key, value in numeric.items():
            gauge = _gauges.get(key)
            if gauge is None:
                gauge = prometheus_client.Gauge(
                    f"paged_backend_{key}", f"paged-backend engine stat {key}", LABELS
                )
                _gauges[key] = gauge
            gauge.labels(*labels).set(value)
        for key in _exported.get(labels, set()) - numeric.keys():
            _gauges[key].remove(*labels)
        _exported[labels] = set(numeric)
    return True
