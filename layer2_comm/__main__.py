"""`python -m layer2_comm` = `stack run --layer 2`: every collective checked and timed."""
import sys

from .commands import run

sys.exit(run(sys.argv[1:]))
