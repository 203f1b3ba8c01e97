"""`python -m ringtree ...` (and `torchrun ... -m ringtree ...`) runs the command-line interface."""

from ringtree.cli import main

main()
