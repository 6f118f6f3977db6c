"""Commands that build an engine to measure it (the cost-model profiler)."""
