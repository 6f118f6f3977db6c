"""Serve a model over the OpenAI API: a thin example over `nanoserve serve` (nanoserve/server/serve.py),
runnable from a checkout without installing.

    python examples/serve.py                       # the embedded SmolLM2-135M-Instruct on :8000
    python examples/serve.py /path/to/hf/model --port 9000 --policy fcfs
    torchrun --nnodes 1 --nproc-per-node 2 examples/serve.py DIR     # every rank runs it; rank 0 serves
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from nanoserve.server.serve import add_serve_arguments, serve  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_serve_arguments(parser)
    serve(parser.parse_args())
