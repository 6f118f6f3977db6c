"""`Submission`: one request as KunServe's cluster hands it to an instance (the "add" message,
cluster/instance.py), keeps it to start it again on a live instance if its own dies (§4.4), and
gets it back from a throttled instance's queue to dispatch it again after a drop (§3).
"""
from __future__ import annotations

from dataclasses import dataclass

from nanoserve.sampling import SamplingParams
from nanoserve.slo import SLO, RequestClass


@dataclass(frozen=True)
class Submission:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    priority: RequestClass = RequestClass.ONLINE
    slo: SLO | None = None  # None: the class's targets
    prompt_text: str | None = None  # the text behind the token ids, if the client sent one
    arrival_time: float | None = None  # None: when the instance takes it (time.monotonic, as its clock)

    def __post_init__(self) -> None:
        object.__setattr__(self, "priority", RequestClass(self.priority))  # "online"/"offline" too

