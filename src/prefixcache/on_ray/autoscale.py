"""Ray Serve's autoscaling on what the engines report, not on Ray's own request counts.

Requests reach the engines through our router, not through Ray's handles, so Ray counts
none of them. Each replica reports its server's running + waiting requests
(``EngineReplica.record_autoscaling_stats``); the policy asks for enough replicas that each
carries ``target_ongoing_requests``. Ray applies the bounds, delays and factors around it.
"""

from __future__ import annotations

from typing import Any

from ray.serve.config import AutoscalingContext

from prefixcache.on_ray.replica import LOAD_METRIC

POLICY_PATH = "prefixcache.on_ray.autoscale:engine_load_policy"


def engine_load_policy(context: AutoscalingContext) -> tuple[float, dict[str, Any]]:
    """Replicas wanted: the engines' total load over the target per replica."""
    if context.current_num_replicas == 0:
        return context.target_num_replicas, {}
    loads = (context.aggregated_metrics or {}).get(LOAD_METRIC, {})
    target = context.config.get_target_ongoing_requests()
    return sum(loads.values()) / target, {}
