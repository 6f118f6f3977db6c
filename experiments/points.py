"""Finished points of a long experiment, saved as they finish so that a stopped run resumes
(ours). A paper-scale sweep runs for hours on a laptop; each of its points (one system at one
rate on one seed) is a simulation whose numbers fit in a row. The experiment names a point by a
key that holds everything the row depends on (its trace, system, rate, seed, and a version
bumped when a code change makes saved rows stale); this file keeps the rows, one JSON object per
line, appended as each point finishes.

    saved = SavedPoints("sharegpt-seed1.jsonl")     # None: nothing read, nothing written
    row = saved.point(key, lambda: simulate(...), numbers_of)   # read back, or run and saved

The code that simulated a saved row is whatever the checkout was when it ran, so keep the file
with the commit that wrote it (benchmarks/results/ does).
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from experiments.progress import Progress
from nanoserve.sim.simulation import SimResult


def read_points(path: str | Path) -> dict[str, dict]:
    """The rows a points file holds, by key (a key saved twice: its last row). The plots read
    saved runs with this, without simulating."""
    rows: dict[str, dict] = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            entry = json.loads(line)
            rows[entry["key"]] = entry["row"]
    return rows


class SavedPoints:
    """Rows by key, read from a JSON-lines file and appended to it as points finish."""

    def __init__(self, path: str | Path | None):
        self.path = None if path is None else Path(path)
        self.rows: dict[str, dict] = read_points(self.path) if self.path is not None and self.path.exists() else {}

    def get(self, key: str) -> dict | None:
        return self.rows.get(key)

    def add(self, key: str, row: dict) -> None:
        """Save a finished point; a key already saved (a point simulated again because its run,
        not just its row, was needed) is not written twice."""
        saved_before = key in self.rows
        self.rows[key] = row
        if self.path is not None and not saved_before:
            with self.path.open("a") as f:
                f.write(json.dumps({"key": key, "row": row}) + "\n")

    def point(self, key: str, simulate_it: Callable[[], SimResult], stats_of: Callable[[SimResult], dict],
              runs: dict[str, SimResult] | None = None, name: str = "", progress: Progress | None = None,
              rerun: bool = False) -> dict:
        """The row saved under `key`, or `stats_of(simulate_it())`, saved (the run kept in `runs`
        under `name`, if given). `rerun`: simulate even if saved (the caller needs the run, not
        just its row). `progress` counts the point, with its simulated seconds if it ran (a row
        read back simulated nothing)."""
        row = None if rerun else self.get(key)
        if row is None:
            result = simulate_it()
            if runs is not None:
                runs[name] = result
            row = stats_of(result)
            self.add(key, row)
            if progress is not None:
                progress.done(result.duration)
        elif progress is not None:
            progress.done()
        return row
