"""`python -m layer0_hardware` runs the layer-0 demo (the same as `stack run --layer 0`)."""
import sys

from .commands import run

if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
