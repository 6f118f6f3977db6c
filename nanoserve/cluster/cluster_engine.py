"""`ClusterEngine`: KunServe's cluster (cluster/cluster.py) as a `ServingEngine` (serving.py), so
that the OpenAI server drives N data-parallel replicas, their dispatcher, drops and restores as
it drives one engine (`nanoserve serve --instances N [--drop]`):

    AsyncEngine ──add/abort/step──► ClusterEngine ──► Cluster ──► instance 0 .. N-1 (processes)
      handlers ──tokenize/validate─┘  (here, in the server's process: nothing is queued for a bad request)

Under torchrun the instances are the ranks (cluster/torchrun_instances.py) and this front is
rank 0's; nothing else here changes.

The instances run the engines; this front holds what the server asks of an engine without a
round trip: the tokenizer (loaded here from the same model directory), the facts the instances
report when they start (`EngineFacts`: the context length, sampling defaults, ...), and the
structured-output library requests are checked with. It keeps the counts that only the front
sees exactly (prompt tokens admitted, requests finished, each class's SLO attainment: a request
re-dispatched after a drop leaves one instance and starts on another) and sums the instances'
counters for the rest.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

from nanoserve.builder import model_path
from nanoserve.cluster.cluster import STEPPINGS, Cluster
from nanoserve.cluster.engine_facts import EngineFacts
from nanoserve.cluster.instance_launcher import InstanceLauncher
from nanoserve.cluster_stats import ClusterStats
from nanoserve.config import EngineArgs, SchedulerConfig
from nanoserve.engine_stats import EngineStats
from nanoserve.grammar import GrammarBackend, make_backend
from nanoserve.outputs import RequestOutput
from nanoserve.sampling import SamplingParams
from nanoserve.serving import ServingEngine
from nanoserve.slo import PRIORITIES, SLO, ClassMetrics, RequestClass
from nanoserve.tokenizer import Tokenizer


class ClusterEngine(ServingEngine):
    @classmethod
    def start(cls, args: EngineArgs, num_instances: int, drop: bool = False,
              launcher: InstanceLauncher | None = None, stepping: str = STEPPINGS[0]) -> ClusterEngine:
        """Start `num_instances` instances of `args` (with KunServe's drop if `drop`) and the front;
        `launcher`: where they run (default: processes of this machine; `TorchrunInstances`: the
        ranks of a torchrun world); `stepping`: `Cluster`'s."""
        path = model_path(args)  # first here: the embedded model converts once, before the instances look
        tokenizer = Tokenizer.from_dir(path, args.chat_template) if (path / "tokenizer.json").exists() else None
        cluster = Cluster(args, num_instances, drop=drop, launcher=launcher, stepping=stepping)
        try:
            return cls(cluster, tokenizer)
        except BaseException:
            cluster.shutdown()
            raise

    def __init__(self, cluster: Cluster, tokenizer: Tokenizer | None):
        self.cluster = cluster
        replies = cluster.call_all({i: ("facts",) for i in cluster.loads})
        facts: list[EngineFacts] = [reply for reply in replies.values() if isinstance(reply, EngineFacts)]
        if len(facts) != len(replies):
            raise RuntimeError(f"an instance did not describe its engine: {replies}")
        self.facts = min(facts, key=lambda f: f.config.max_model_len)
        self.model_name = self.facts.model_name
        self.tokenizer = tokenizer
        self.reasoning_parser = self.facts.reasoning_parser
        self.sampling_defaults: Mapping[str, Any] = self.facts.sampling_defaults
        self.last_step_tokens = 0
        self._grammar_backend: GrammarBackend | None = None
        self._requests: dict[str, tuple[RequestClass, SLO]] = {}  # unfinished: the class and targets met
        self._prompt_tokens = 0
        self._finished = 0
        self._class_metrics = {priority: ClassMetrics() for priority in PRIORITIES}

    @property
    def config(self) -> SchedulerConfig:
        return self.facts.config

    def supports_prompt_logprobs(self) -> bool:
        return self.facts.supports_prompt_logprobs

    def grammar_backend(self) -> GrammarBackend:
        """The library the instances compile with, built here once (to check constraints)."""
        if self._grammar_backend is None:
            if self.tokenizer is None:
                raise ValueError("structured outputs need a tokenizer; this model has none")
            self._grammar_backend = make_backend(self.facts.structured_outputs_backend, self.tokenizer,
                                                 self.facts.vocab_size or self.tokenizer.vocab_size)
        return self._grammar_backend

    # -- requests ----------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                    arrival_time: float | None = None, prompt_text: str | None = None,
                    priority: RequestClass | str = RequestClass.ONLINE, slo: SLO | None = None) -> int:
        """Returns the instance the dispatcher sent it to."""
        token_ids = self.tokenize(prompt)
        self.validate(len(token_ids), params)
        if request_id is None:
            raise ValueError("a cluster's requests need an id (the server gives each one)")
        priority = RequestClass(priority)
        instance = self.cluster.add_request(request_id, token_ids, params, priority, slo=slo,
                                            prompt_text=prompt if isinstance(prompt, str) else prompt_text,
                                            arrival_time=arrival_time)
        self._requests[request_id] = (priority, slo if slo is not None else self.config.slo_for(priority))
        self._prompt_tokens += len(token_ids)
        return instance

    def abort_request(self, request_id: str) -> RequestOutput | None:
        out = self.cluster.abort_request(request_id)
        if self._requests.pop(request_id, None) is not None:
            self._finished += 1
        return out

    def step(self) -> list[RequestOutput]:
        outputs = self.cluster.step()
        self.last_step_tokens = self.cluster.last_step_tokens
        for out in outputs:
            if out.finished and (request := self._requests.pop(out.request_id, None)) is not None:
                self._finished += 1
                m = out.metrics
                if out.finish_reason != "abort" and m.e2e is not None:
                    priority, slo = request
                    self._class_metrics[priority].observe(m.ttft, m.tpot, m.num_output_tokens, slo, m.arrival_time,
                                                          m.arrival_time + m.e2e)
        return outputs

    def has_unfinished_requests(self) -> bool:
        """Requests to serve, or a layout change still under way (an exchange, a pull, a group an
        idle step would restore): the serving loop steps until the cluster has settled."""
        return self.cluster.has_unfinished_requests() or not self.cluster.settled()

    def unfinished_request_ids(self) -> list[str]:
        return self.cluster.unfinished_request_ids()

    def reset_prefix_cache(self) -> int:
        return self.cluster.reset_prefix_cache()

    # -- what the metrics read -----------------------------------------------------------------
    def stats(self) -> EngineStats:
        """The instances together: running, waiting and KV as they reported after the latest
        step, their counters summed; prompt tokens, finished requests and each class's outcomes
        as this front saw them."""
        cluster, parts = self.cluster.stats(), self.cluster.engine_stats()
        events: Counter[str] = Counter()
        policy: Counter[str] = Counter()
        for part in parts:
            events.update(part.kv_events)
            policy.update(part.policy_counters)
        return EngineStats(
            num_running=sum(cluster.num_running.values()), num_waiting=sum(cluster.num_waiting.values()),
            kv_blocks_used=sum(cluster.kv_blocks_used.values()), kv_blocks_total=sum(cluster.kv_blocks_total.values()),
            num_preemptions=sum(p.num_preemptions for p in parts), prompt_tokens_total=self._prompt_tokens,
            generation_tokens_total=sum(p.generation_tokens_total for p in parts),
            requests_finished_total=self._finished, kv_events=dict(events), policy_counters=dict(policy),
            per_class={priority: m.summary() for priority, m in self._class_metrics.items()},
            step_seconds_total=sum(p.step_seconds_total for p in parts),
            predicted_step_seconds_total=sum(p.predicted_step_seconds_total for p in parts))

    def cluster_stats(self) -> ClusterStats:
        return self.cluster.stats()

    def shutdown(self) -> None:
        self.cluster.shutdown()
