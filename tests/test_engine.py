"""Engine behaviour through the public API on SmolLM2: stop conditions, streaming deltas,
seeds, aborts and request validation."""
from __future__ import annotations

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.async_engine import AsyncEngine


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    return LLM(str(smollm2_dir), device="cpu", kv_cache_tokens=4096, max_model_len=512)


def stream(engine, prompt, params):
    """Drive the engine by hand and collect every output of one request."""
    request = engine.add_request(prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == request.request_id]
    return outputs


def test_max_tokens_and_ignore_eos(llm):
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=7, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"
    assert out.metrics.num_output_tokens == 7 and out.metrics.ttft > 0 and out.metrics.tpot > 0


def test_stop_string_truncates_text(llm):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    full = llm.generate("Count: one, two, three,", params, use_tqdm=False)[0]
    stop = full.text[5:8]  # something the model is known to produce
    out = llm.generate("Count: one, two, three,", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                             stop=[stop]), use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[: full.text.index(stop)]


def test_streamed_deltas_add_up_and_hold_back_partial_stop_strings(llm):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=["NEVER-APPEARS-123"])
    outputs = stream(llm.engine, "Write a sentence about the sea.", params)
    assert "".join(o.new_text for o in outputs) == outputs[-1].text
    assert sum(len(o.new_token_ids) for o in outputs) == len(outputs[-1].token_ids) == 30
    # While running, up to len(stop) - 1 characters are held back in case a stop string forms.
    held = len(outputs[-2].text) - sum(len(o.new_text) for o in outputs[:-1])
    assert 0 <= held <= len("NEVER-APPEARS-123") - 1


def test_stop_token_ids(llm):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    full = llm.generate("The alphabet: a, b, c,", params, use_tqdm=False)[0]
    stop_token = full.token_ids[3]
    out = llm.generate("The alphabet: a, b, c,", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                           stop_token_ids=[stop_token]), use_tqdm=False)[0]
    assert out.token_ids == full.token_ids[: full.token_ids.index(stop_token) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_token


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234, ignore_eos=True)
    alone = llm.generate("Tell me a story", seeded, use_tqdm=False)[0]
    others = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    batch = llm.generate(["Tell me a story", "Other prompt", "Yet another one"], [seeded, others, others],
                         use_tqdm=False)
    assert batch[0].token_ids == alone.token_ids
    unseeded = llm.generate(["Tell me a story"] * 2, SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True),
                            use_tqdm=False)
    assert unseeded[0].token_ids != unseeded[1].token_ids  # 16 random tokens colliding is vanishingly rare


def test_generate_builds_outputs_only_for_finished_requests_and_streams_again_after(llm, monkeypatch):
    """`LLM.generate` returns finished requests only, so its engine builds no per-token output
    (not even a core output, for requests without stop strings); a stream driven by hand
    afterwards (or after a failed generate) gets every delta again."""
    built = []
    output = llm.engine._core_output
    monkeypatch.setattr(llm.engine, "_core_output", lambda request, now: (built.append(request.is_finished),
                                                                          output(request, now))[1])
    outs = llm.generate(["Hello", "The sea"], SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
                        use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [9, 9] and built == [True, True]
    monkeypatch.setattr(llm.engine, "step", lambda: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        llm.generate("Hello", SamplingParams(max_tokens=3), use_tqdm=False)
    monkeypatch.undo()
    assert llm.engine.stream_outputs and len(stream(llm.engine, "Hi",
                                                    SamplingParams(max_tokens=4, ignore_eos=True))) == 4


def test_abort_frees_blocks(llm):
    engine = llm.engine
    request = engine.add_request("A long story begins", SamplingParams(max_tokens=200, ignore_eos=True))
    engine.add_request("Another one", SamplingParams(max_tokens=200, ignore_eos=True), request_id="queued")
    engine.step()
    assert engine.kv.num_used_blocks > 0
    out = engine.abort_request(request.request_id)
    assert out.finish_reason == "abort" and out.finished
    engine.abort_request("queued")
    assert engine.abort_request("no-such-request") is None
    assert engine.kv.num_used_blocks == 0 and not engine.has_unfinished_requests()


@pytest.mark.parametrize("prompt, params, message", [
    ("x " * 600, SamplingParams(max_tokens=1), "maximum context length is 512"),
    ("Hello", SamplingParams(max_tokens=600), "maximum context length is 512"),
    ([], SamplingParams(), "at least one token"),
    ([1, 2, 10**9], SamplingParams(), "token ids must be integers"),
])
def test_requests_that_cannot_be_served_are_refused(llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([prompt], params, use_tqdm=False)
    assert llm.engine.kv.num_used_blocks == 0 and not llm.engine.has_unfinished_requests()


def test_generate_checks_the_number_of_params(llm):
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate(["a"], [SamplingParams(), SamplingParams()], use_tqdm=False)


def test_async_engine_refuses_work_when_stopped(llm):
    import asyncio

    from nanoserve.async_engine import EngineError

    async def first_output():
        async for out in AsyncEngine(llm.engine).generate("hi", SamplingParams(max_tokens=1)):
            return out

    with pytest.raises(EngineError, match="not running"):
        asyncio.run(first_output())


def test_async_engine_build_runs_on_a_thread_that_has_ended(llm):
    """AsyncEngine.build calls its factory on another thread, which has ended when it returns
    (so that thread's OpenMP pool is gone: nanoserve/async_engine.py), and the engine it built
    serves; an error in the factory reaches the caller."""
    import asyncio
    import threading

    built_on: list[threading.Thread] = []

    def make():
        built_on.append(threading.current_thread())
        return llm.engine

    async_engine = AsyncEngine.build(make)
    assert async_engine.engine is llm.engine
    assert built_on[0] is not threading.current_thread() and not built_on[0].is_alive()

    async def tokens():
        async for out in async_engine.generate("hi", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)):
            if out.finished:
                return out.token_ids

    async_engine.start()
    try:
        assert len(asyncio.run(tokens())) == 3
    finally:
        async_engine.shutdown()

    def broken():
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        AsyncEngine.build(broken)


def test_shutdown_frees_the_model_and_host_kv_even_while_the_engine_is_held(smollm2_dir):
    """A shut-down engine keeps no weights, device KV or host KV, though something still holds
    it (as FastAPI's endpoint cache holds a server's engine); it refuses to step, and its
    tokenizer and counters still answer."""
    import gc
    import weakref

    llm = LLM(str(smollm2_dir), device="cpu", kv_cache_tokens=1024, max_model_len=256, policy="conserve")
    engine = llm.engine
    llm.generate("Hello", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    model, store = weakref.ref(engine.executor.model), engine.kv.host_store
    assert store is not None and store.k.numel() > 0
    llm.shutdown()
    gc.collect()
    assert model() is None, "the weights outlived shutdown"
    assert store.k.numel() == store.v.numel() == 0 and store.num_blocks == 0
    assert engine.stats().generation_tokens_total == 3 and engine.tokenize("Hello")
    engine.add_request("Hello", SamplingParams(max_tokens=1))
    with pytest.raises(RuntimeError, match="shut down"):
        engine.step()
    llm.shutdown()  # twice is fine
