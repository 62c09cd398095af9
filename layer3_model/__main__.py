"""`python -m layer3_model` = `stack run --layer 3`: the course model writes a scene, streamed."""
import sys

from layer2_comm import run_command

from .commands import run

sys.exit(run_command(run, sys.argv[1:]))  # a user's mistake: one line, exit 2
