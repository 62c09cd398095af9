"""`python -m layer0_hardware` runs the layer-0 demo (the same as `stack run --layer 0`)."""
import sys

from .commands import run
from .usage import run_command

if __name__ == "__main__":
    sys.exit(run_command(run, sys.argv[1:]))
