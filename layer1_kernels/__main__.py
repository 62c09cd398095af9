"""`python -m layer1_kernels` = `stack run --layer 1`."""
import sys

from .commands import run

sys.exit(run(sys.argv[1:]))
