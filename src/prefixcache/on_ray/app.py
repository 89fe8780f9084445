"""The Ray Serve application: deployment options from the CLI's choices."""

from __future__ import annotations

from dataclasses import dataclass, field

from ray import serve
from ray.serve import Application

from prefixcache.on_ray.autoscale import POLICY_PATH
from prefixcache.on_ray.ingress import RouterIngress
from prefixcache.on_ray.replica import EngineReplica
from prefixcache.on_ray.specs import ENGINE, INGRESS, EngineSpec, IngressSpec

HEALTH_CHECK_PERIOD_S = 2.0
HEALTH_CHECK_TIMEOUT_S = 10.0
MAX_ONGOING = 1024  # our server queues and refuses (429) by itself; Ray must not cap it first
HEAD_NODE = {"node:__internal_head__": 0.001}  # the ingress listens where the CLI says


@dataclass(frozen=True, slots=True)
class Scaling:
    """Fixed ``replicas``, or Ray's autoscaling between ``minimum`` and ``maximum``."""

    replicas: int
    minimum: int | None = None
    maximum: int | None = None
    target_ongoing: float = 2.0
    cpus: float = 1.0
    per_node: int | None = None  # max_replicas_per_node
    tuning: dict = field(default_factory=dict)  # Ray's autoscaling delays and window

    def options(self) -> dict:
        """Serve's deployment options for the engine."""
        options: dict = {
            "ray_actor_options": {"num_cpus": self.cpus},
            "max_ongoing_requests": MAX_ONGOING,
            "health_check_period_s": HEALTH_CHECK_PERIOD_S,
            "health_check_timeout_s": HEALTH_CHECK_TIMEOUT_S,
        }
        if self.per_node is not None:
            options["max_replicas_per_node"] = self.per_node
        if self.maximum is None:
            options["num_replicas"] = self.replicas
            return options
        options["autoscaling_config"] = {
            "min_replicas": self.minimum if self.minimum is not None else 1,
            "max_replicas": self.maximum,
            "initial_replicas": self.replicas,
            "target_ongoing_requests": self.target_ongoing,
            "policy": {"policy_function": POLICY_PATH},
            **self.tuning,
        }
        return options


def build_app(engine: EngineSpec, ingress: IngressSpec | None, scaling: Scaling) -> Application:
    """The engine behind our router, or (``ingress`` None) alone behind Ray's proxy."""
    engines = serve.deployment(EngineReplica, name=ENGINE, **scaling.options()).bind(engine)
    if ingress is None:
        return engines
    front = serve.deployment(
        RouterIngress,
        name=INGRESS,
        num_replicas=1,
        ray_actor_options={"num_cpus": 0, "resources": HEAD_NODE},
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
    )
    return front.bind(ingress, engines)
