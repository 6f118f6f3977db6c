"""KunServe's cluster (kunserve.txt §4): full replicas in their own processes behind a
KV-balancing dispatcher; under memory throttling, instances drop replicated layers and serve as
one pipeline (drop plan, KV exchange), then restore. It runs engines, so it sits above them."""
