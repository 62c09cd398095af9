"""`python -m layer3_model` = `stack run --layer 3`: the course model writes a scene, streamed."""
import sys

from .commands import run

sys.exit(run(sys.argv[1:]))
