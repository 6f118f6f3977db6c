"""`python -m nanoserve COMMAND ...`: the `nanoserve` command (cli.py)."""
import sys

from nanoserve.cli import main

sys.exit(main())
