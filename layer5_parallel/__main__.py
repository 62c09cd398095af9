"""`python -m layer5_parallel` = `stack run --layer 5`: tensor-parallel generation vs TP=1."""
import sys

import layer4_algorithms as engine

from .bench.commands import run

# A user's mistake: one line and exit code 2 (layer 0's rule, relayed up the stack).
sys.exit(engine.run_command(run, sys.argv[1:]))
