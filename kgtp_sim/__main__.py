"""`python -m kgtp_sim`: the `kgtp-sim` command (cli.py), which runs on the main thread."""

from .cli import entry

entry()
