"""`python -m experiments EXPERIMENT [...]` from the checkout's root (see cli.py)."""
import sys

from experiments.cli import main

sys.exit(main())
