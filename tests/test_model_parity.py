"""nanoserve's models against transformers on small random-weight checkpoints (fp32).

Prompt logits go through the real paged path (runner → store_kv → paged attention); greedy
continuations go through the whole engine, compared with HF `generate`.
"""
from __future__ import annotations

import pytest
import torch
from conftest import TINY_VOCAB, build_tiny_model

from nanoserve import LLM, SamplingParams
from nanoserve.memory.blocks import BlockPool
from nanoserve.model.attention import get_attention_backend
from nanoserve.model.loader import load_model
from nanoserve.model.runner import ModelRunner
from nanoserve.request import Request
from nanoserve.sched import ScheduledChunk, SchedulerOutput

PROMPT_LENGTHS = [1, 5, 17, 40]


def prompts(n: int = 4) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, TINY_VOCAB, (length,), generator=g).tolist() for length in PROMPT_LENGTHS[:n]]


def nanoserve_prompt_logits(directory, token_ids: list[int], block_size: int = 4) -> torch.Tensor:
    model, cfg = load_model(directory, torch.device("cpu"), torch.float32)
    pool = BlockPool(64, block_size)
    runner = ModelRunner(model, cfg, 64, block_size, torch.device("cpu"), torch.float32, get_attention_backend("torch"))
    pool.allocate("p", len(token_ids))
    request = Request("p", token_ids, SamplingParams())
    hidden = runner.run_model(runner.prepare(
        SchedulerOutput([ScheduledChunk(request, 0, len(token_ids), pool.block_table("p"))])))
    with torch.no_grad():
        return model.compute_logits(hidden)


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, tol: float = 1e-4) -> None:
    scale = float(ref.max() - ref.min())
    err = float((ours - ref).abs().max())
    assert err <= tol * scale, f"max abs error {err:.3g} exceeds {tol} x logit range {scale:.3g}"


def test_prompt_logits_match_hf(tiny_model):
    arch, hf, directory = tiny_model
    for ids in prompts():
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        assert_logits_close(nanoserve_prompt_logits(directory, ids), ref)


def test_greedy_tokens_match_hf_generate(tiny_model):
    arch, hf, directory = tiny_model
    llm = LLM(str(directory), device="cpu", kv_cache_tokens=4096, block_size=8)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outputs = llm.generate(prompts(), params, use_tqdm=False)
    for ids, out in zip(prompts(), outputs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out.token_ids == ref[0, len(ids):].tolist(), f"{arch}: prompt of {len(ids)} tokens diverged"
        assert out.finish_reason == "length"


def test_loads_pytorch_bin_checkpoints(tmp_path):
    from safetensors.torch import load_file

    hf = build_tiny_model("llama", tmp_path)
    # transformers v5 only writes safetensors; older checkpoints ship pytorch_model.bin.
    torch.save(load_file(tmp_path / "model.safetensors"), tmp_path / "pytorch_model.bin")
    (tmp_path / "model.safetensors").unlink()
    ids = prompts(3)[2]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert_logits_close(nanoserve_prompt_logits(tmp_path, ids), ref)


def test_loads_sharded_safetensors(tmp_path):
    hf = build_tiny_model("qwen3", tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    ids = prompts(3)[2]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert_logits_close(nanoserve_prompt_logits(tmp_path, ids), ref)


def test_missing_weight_fails_loudly(tmp_path):
    from safetensors.torch import load_file, save_file

    build_tiny_model("qwen2", tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.bias"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(KeyError, match="k_proj|qkv_proj"):
        load_model(tmp_path, torch.device("cpu"), torch.float32)


def _save_tiny(model_cls, config, directory):
    torch.manual_seed(4321)
    model = model_cls(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.generation_config.eos_token_id = None
    model.save_pretrained(directory)
    return model.eval()


@pytest.mark.parametrize("kind", ["mistral", "qwen2-yarn"])
def test_models_users_have(kind, tmp_path):
    """Mistral through the Llama class (its sliding window caps the context), and a Qwen2.5-style
    YaRN RoPE scaling: prompt logits and greedy tokens as transformers computes them."""
    import transformers

    common = dict(vocab_size=TINY_VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=128, initializer_range=0.1)
    if kind == "mistral":
        hf = _save_tiny(transformers.MistralForCausalLM, transformers.MistralConfig(
            **common, max_position_embeddings=512, sliding_window=256), tmp_path)
    else:
        hf = _save_tiny(transformers.Qwen2ForCausalLM, transformers.Qwen2Config(
            **common, max_position_embeddings=128, tie_word_embeddings=True,
            rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}), tmp_path)
    for ids in prompts():
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        assert_logits_close(nanoserve_prompt_logits(tmp_path, ids), ref)
    llm = LLM(str(tmp_path), device="cpu", kv_cache_tokens=4096, block_size=8)
    if kind == "mistral":
        assert llm.engine.config.max_model_len == 256  # the window
    out = llm.generate(prompts()[2], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)[0]
    with torch.no_grad():
        ref_ids = hf.generate(torch.tensor([prompts()[2]]), max_new_tokens=24, do_sample=False)[0, len(prompts()[2]):]
    assert out.token_ids == ref_ids.tolist()


@pytest.mark.parametrize("scaling", [{"rope_type": "dynamic", "factor": 2.0},
                                     {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}])
def test_unsupported_rope_scaling_is_refused_by_name(scaling):
    from nanoserve.model.loader import parse_config

    raw = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
           "num_attention_heads": 2, "intermediate_size": 16, "rope_scaling": scaling}
    with pytest.raises(ValueError, match=scaling["rope_type"]):
        parse_config(raw)
