"""Scale-out on Ray (the `ray` extra): `RayEngine` runs `AsyncEngine` replicas in Ray actors
behind a prefix-aware `Router`. The router is plain Python; `RayEngine` imports Ray, so it is
loaded on first use and the package imports without Ray."""

from __future__ import annotations

from typing import TYPE_CHECKING

from paged_backend.distributed.router import ROUTING_POLICIES, NoReplicaError, Router

if TYPE_CHECKING:
    from paged_backend.distributed.engine import RayEngine


def __getattr__(name: str):
    if name == "RayEngine":
        from paged_backend.distributed.engine import RayEngine

        return RayEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ROUTING_POLICIES", "NoReplicaError", "RayEngine", "Router"]
