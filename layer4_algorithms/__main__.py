"""`python -m layer4_algorithms` = `stack run --layer 4`: the engine serves the course model."""
import sys

from .commands import run

sys.exit(run(sys.argv[1:]))
