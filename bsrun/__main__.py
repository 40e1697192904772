"""`python -m bsrun`: the command line, as the `bsrun` script runs it."""

from bsrun.cli import main

main()
