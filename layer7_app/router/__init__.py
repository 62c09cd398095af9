"""The replica router (layer 7): an OpenAI-compatible proxy over layer-6 servers.

policies.py (round_robin, least_loaded, prefix_aware), replicas.py (health and load),
proxy.py (forwarding, streaming pass-through, failover), app.py (the FastAPI app and
`start_router`), autoscale.py (start/stop local replicas on queue depth), main.py
(`stack route`). Its benchmarks are in `layer7_app.bench`.
"""
from .app import RouterHandle, create_router_app, start_router
from .autoscale import Autoscaler
from .main import route_main
from .policies import (
    POLICIES,
    LeastLoaded,
    PrefixAware,
    RoundRobin,
    hash_score,
    make_policy,
    prefix_key,
)
from .replicas import Replica, ReplicaSet

__all__ = ["start_router", "create_router_app", "RouterHandle", "Autoscaler", "route_main",
           "POLICIES", "make_policy", "RoundRobin", "LeastLoaded", "PrefixAware", "prefix_key",
           "hash_score",
           "Replica", "ReplicaSet"]
