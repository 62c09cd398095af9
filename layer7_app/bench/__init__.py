"""Layer 7's benchmarks, apart from the app: the router's prefix_aware vs round_robin on a
multi-turn chat workload (router.py) and autoscaling under a ramp (autoscale.py).

Nothing in the app imports this package; it imports the app.
"""
