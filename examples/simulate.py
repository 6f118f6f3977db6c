"""Re-run a paper's headline comparison in the simulator: a thin wrapper over
`python -m experiments` (experiments/cli.py), runnable from anywhere in a checkout.

    python examples/simulate.py kunserve
    python examples/simulate.py ecoserve --scale ci --seed 0 1 2
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's experiments/ package

from experiments.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
