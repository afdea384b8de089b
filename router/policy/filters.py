"""Filters: which replicas may take a request at all.

A filter that would leave no replica is relaxed instead (skipped, and named in the
decision): sending a request to a replica that may be down beats refusing it outright,
and the proxy's failover down the ranked list covers the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from router.policy.types import ReplicaState, RoutingRequest


@dataclass(frozen=True)
class Filter:
    """A named predicate over (request, replica)."""

    name: str
    keep: Callable[[RoutingRequest, ReplicaState], bool]


def _serves_model(request: RoutingRequest, replica: ReplicaState) -> bool:
    return replica.models is None or request.model in replica.models


def _healthy(request: RoutingRequest, replica: ReplicaState) -> bool:
    return replica.healthy


def _not_ejected(request: RoutingRequest, replica: ReplicaState) -> bool:
    return not replica.ejected


SERVES_MODEL = Filter("serves_model", _serves_model)
HEALTHY = Filter("healthy", _healthy)
NOT_EJECTED = Filter("not_ejected", _not_ejected)
DEFAULT_FILTERS: tuple[Filter, ...] = (SERVES_MODEL, HEALTHY, NOT_EJECTED)


def apply_filters(
    filters: Sequence[Filter], request: RoutingRequest, replicas: Sequence[ReplicaState]
) -> tuple[list[ReplicaState], tuple[str, ...]]:
    """The replicas every filter keeps, and the names of filters relaxed to keep one."""
    eligible = list(replicas)
    relaxed: list[str] = []
    for f in filters:
        kept = [r for r in eligible if f.keep(request, r)]
        if kept:
            eligible = kept
        else:
            relaxed.append(f.name)
    return eligible, tuple(relaxed)
