"""`python -m layer2_comm` = `stack run --layer 2`: every collective checked and timed."""
import sys

from layer1_kernels import hardware

from .commands import run

sys.exit(hardware.run_command(run, sys.argv[1:]))  # a user's mistake: one line, exit code 2
