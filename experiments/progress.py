"""Progress of a long experiment (ours): points done of the total, simulated seconds per wall
second, and the time left, on a tqdm bar on stderr.

A paper-scale sweep runs for hours on a laptop (10,000 requests per rate, seven systems, ten
rates), so a reader wants to see that it moves and when it will end. Each finished point reports
the virtual seconds it simulated; the bar shows their rate against the wall clock, and tqdm the
ETA from the points' pace. A point read back from a saved file (a resumed sweep) advances the bar
without simulated time.

    progress = Progress(total=len(points), label="EcoServe ShareGPT")
    for point in points:
        result = simulate(...)
        progress.done(result.duration)
    progress.close()

By default the bar is drawn only when stderr is a terminal (tqdm's `disable=None`: not in CI
logs or under pytest); `NANOSERVE_PROGRESS=1` draws it anyway (a run under nohup, its log read
with `tail`), `NANOSERVE_PROGRESS=0` never.
"""
from __future__ import annotations

import os
import time

from tqdm import tqdm


class Progress:
    def __init__(self, total: int, label: str):
        setting = os.environ.get("NANOSERVE_PROGRESS")
        disable = {"0": True, "1": False}.get(setting or "")  # None: only on a terminal
        self._bar = tqdm(total=total, desc=label, unit="point", disable=disable, leave=disable is None,
                         mininterval=5.0 if disable is False else 0.1)
        self._started = time.perf_counter()
        self.simulated = 0.0  # virtual seconds simulated so far (resumed points add none)

    def done(self, simulated_seconds: float = 0.0) -> None:
        """One point finished, having simulated `simulated_seconds` (0: read back, not simulated)."""
        self.simulated += simulated_seconds
        wall = max(time.perf_counter() - self._started, 1e-9)
        self._bar.set_postfix_str(f"{self.simulated / wall:.0f} sim-s/s", refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()
