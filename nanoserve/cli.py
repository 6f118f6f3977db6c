"""The `nanoserve` command (pyproject's console script; also `python -m nanoserve`).

    nanoserve serve [MODEL] [--flags]     the OpenAI-compatible server (server/serve.py)
    nanoserve bench [MODEL] [--flags]     offline throughput of one configuration (tools/bench.py)
    nanoserve profile [MODEL] [--flags]   fit the policies' iteration cost model (tools/profile.py)
    nanoserve simulate POLICY ...         policies on a virtual clock, a named GPU and model (sim/cli.py)

Each command's module defines its flags (`add_arguments`) and runs them (`run`); the engine's
flags and their defaults come from `EngineArgs` (engine_flags.py). A command's module is
imported only when it runs, so `nanoserve --help` loads neither torch nor the server.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import NamedTuple


class Command(NamedTuple):
    module: str
    add_arguments: str  # the module's function that adds the command's flags to a parser
    run: str  # ...and the one that runs it on the parsed flags
    summary: str


COMMANDS: dict[str, Command] = {
    "serve": Command("nanoserve.server.serve", "add_serve_arguments", "serve",
                     "serve a model over the OpenAI API (default: the embedded SmolLM2)"),
    "bench": Command("nanoserve.tools.bench", "add_arguments", "run", "offline throughput: N requests, all at once"),
    "profile": Command("nanoserve.tools.profile", "add_arguments", "run",
                       "time synthetic batches and fit the iteration cost model the policies budget with"),
    "simulate": Command("nanoserve.sim.cli", "add_arguments", "run",
                        "compare policies on a virtual clock over a synthetic workload"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The top parser; with `command`, that command's flags too (imported for them)."""
    parser = argparse.ArgumentParser(prog="nanoserve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"nanoserve {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, spec in COMMANDS.items():
        sub = commands.add_parser(name, help=spec.summary, description=spec.summary)
        if name == command:
            module = importlib.import_module(spec.module)
            sub.description = module.__doc__
            sub.formatter_class = argparse.RawDescriptionHelpFormatter
            getattr(module, spec.add_arguments)(sub)
    return parser


def _version() -> str:
    from nanoserve import __version__

    return __version__


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if a in COMMANDS), None)
    args = build_parser(command).parse_args(argv)
    spec = COMMANDS[args.command]
    getattr(importlib.import_module(spec.module), spec.run)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
