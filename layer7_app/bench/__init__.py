"""Layer 7's tooling, apart from the app: the `stack run/bench --layer 7` commands
(commands.py: a scripted conversation through the chat app, and the router bench), the
router's prefix_aware vs round_robin on a multi-turn chat workload (router.py) and
autoscaling under a ramp (autoscale.py).

Nothing in the app imports this package; it imports the app.
"""
