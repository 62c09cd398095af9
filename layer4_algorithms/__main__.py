"""`python -m layer4_algorithms` = `stack run --layer 4`: the engine serves the course model."""
import sys

from layer3_model import run_command

from .bench.commands import run

# A user's mistake: one line and exit code 2 (layer 0's rule, relayed up the stack).
sys.exit(run_command(run, sys.argv[1:]))
