"""Pure: when an InferenceService that may scale to zero has been idle long enough.

The HPA cannot go below one replica, so with `spec.autoscaling.minReplicas: 0` the
operator takes the last step itself: after `idleSeconds` without a request (the latest
`last_request_at` over every live router) and with nothing in flight or queued, it sets
the InferenceService to 0 through /scale. The idle time counts from the later of the
last request and the moment a group last became available, so a model just woken from
zero (whose first requests arrived before it could serve) gets its full idle period.
Nothing is decided when no router reports the model: without the routers' counts
nobody can tell that it is idle.
"""

from __future__ import annotations

import datetime as dt
from typing import Optional

from kubeshard_operator.load import ModelLoad
from kubeshard_operator.spec import Autoscaling


def may_scale_to_zero(autoscaling: Optional[Autoscaling], replicas: int) -> bool:
    """Whether the idle check applies at all (and the load is worth reading)."""
    return autoscaling is not None and autoscaling.min_replicas == 0 and replicas > 0


def idle_verdict(autoscaling: Optional[Autoscaling], replicas: int, load: Optional[ModelLoad],
                 available_since: Optional[float], now: float) -> Optional[str]:
    """Why to scale to zero now (the ScaledToZero condition's message), or None."""
    if not may_scale_to_zero(autoscaling, replicas) or available_since is None:
        return None
    assert autoscaling is not None
    if load is None or load.routers == 0 or load.concurrency > 0:
        return None
    since = max(load.last_request_at, available_since)
    idle = now - since
    if idle < autoscaling.idle_seconds:
        return None
    last = (f"the last request came at {iso(load.last_request_at)}" if load.last_request_at
            else "no request since the routers started")
    return (f"no request for {idle:.0f} s (idleSeconds is {autoscaling.idle_seconds}; {last}); "
            "the next request scales it up")


def iso(epoch: float) -> str:
    return dt.datetime.fromtimestamp(epoch, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_iso(text: Optional[str]) -> Optional[float]:
    if not text:
        return None
    try:
        return dt.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(
            tzinfo=dt.timezone.utc).timestamp()
    except ValueError:
        return None
