"""`python -m layer6_serving` = `stack run --layer 6`: a server for the course model, driven by
the openai client."""
import sys

from layer5_parallel import run_command

from .bench.commands import run

# A user's mistake: one line and exit code 2 (layer 0's rule, relayed up the stack).
sys.exit(run_command(run, sys.argv[1:]))
