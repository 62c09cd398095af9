"""`python -m layer7_app` = `stack run --layer 7`: the chat app driven by a scripted
conversation, printing what each layer did."""
import sys

from .cli import main

sys.exit(main(["run", "--layer", "7", *sys.argv[1:]]))
