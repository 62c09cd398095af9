"""`python -m layer1_kernels` = `stack run --layer 1`."""
import sys

from layer0_hardware import run_command  # a user's mistake: one line, exit code 2

from .commands import run

sys.exit(run_command(run, sys.argv[1:]))
