"""GGUF (llama.cpp) checkpoints as an HF-style config dict and HF-named float32 tensors.

Only dense decoder architectures are mapped; the table below is the whole of what differs between them.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from gguf.quants import dequantize

from mlaserve.loader.gguf_metadata import GGUFHeader, GGUFTensorInfo, read_gguf_header

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast


@dataclass(frozen=True)
class _Arch:
    architectures: tuple[str, ...]
    model_type: str
    attention_bias: bool
    # llama.cpp reorders q/k rows of llama-family models from HF's rotate-half rope layout to its
    # interleaved one (`permute` in convert_hf_to_gguf.py); Qwen2 runs neox rope in llama.cpp, unpermuted.
    permuted_qk: bool


_ARCHS: dict[str, _Arch] = {
    "llama": _Arch(("LlamaForCausalLM",), "llama", attention_bias=False, permuted_qk=True),
    "qwen2": _Arch(("Qwen2ForCausalLM",), "qwen2", attention_bias=True, permuted_qk=False),
}

# HF config key -> GGUF key under the "{arch}." prefix, for values that need no conversion
_REQUIRED_KEYS = {
    "hidden_size": "embedding_length",
    "intermediate_size": "feed_forward_length",
    "num_hidden_layers": "block_count",
    "num_attention_heads": "attention.head_count",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon",
}
_OPTIONAL_KEYS = {
    "num_key_value_heads": "attention.head_count_kv",
    "rope_theta": "rope.freq_base",
    "max_position_embeddings": "context_length",
}
_TOKEN_ID_KEYS = {
    "bos_token_id": "tokenizer.ggml.bos_token_id",
    "eos_token_id": "tokenizer.ggml.eos_token_id",
    "pad_token_id": "tokenizer.ggml.padding_token_id",
}

_TOP_LEVEL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def _arch_of(header: GGUFHeader) -> _Arch:
    arch = header.architecture
    if arch not in _ARCHS:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r} in {header.path}; supported: {sorted(_ARCHS)}"
        )
    return _ARCHS[arch]


def _config_from_header(header: GGUFHeader) -> dict[str, Any]:
    arch_name, meta = header.architecture, header.metadata
    arch = _arch_of(header)

    def arch_key(key: str) -> str:
        return f"{arch_name}.{key}"

    missing = [arch_key(k) for k in _REQUIRED_KEYS.values() if arch_key(k) not in meta]
    if missing:
        raise ValueError(f"GGUF file {header.path} lacks metadata keys {missing}")
    scaling = meta.get(arch_key("rope.scaling.type"), "none")
    if scaling != "none":
        raise ValueError(f"GGUF file {header.path}: rope scaling {scaling!r} is not supported yet")

    config: dict[str, Any] = {
        "architectures": list(arch.architectures),
        "model_type": arch.model_type,
        **{hf: meta[arch_key(key)] for hf, key in _REQUIRED_KEYS.items()},
        **{hf: meta[arch_key(key)] for hf, key in _OPTIONAL_KEYS.items() if arch_key(key) in meta},
    }
    config.setdefault("num_key_value_heads", config["num_attention_heads"])
    config["vocab_size"] = meta.get(arch_key("vocab_size"), len(meta.get("tokenizer.ggml.tokens", ())))
    if not config["vocab_size"]:
        raise ValueError(f"GGUF file {header.path} has neither {arch_key('vocab_size')} nor a token list")

    # key_length is the explicit head size; older files only carry the rope dimension, equal to it for
    # the full-rotary models mapped here
    head_dim = meta.get(arch_key("attention.key_length"), meta.get(arch_key("rope.dimension_count")))
    if head_dim is not None and head_dim != config["hidden_size"] // config["num_attention_heads"]:
        config["head_dim"] = head_dim
    if arch.attention_bias:
        config["attention_bias"] = True
    # llama.cpp writes no output.weight when the checkpoint ties it to the embedding
    config["tie_word_embeddings"] = "output.weight" not in header.tensor_names()
    config.update({hf: meta[key] for hf, key in _TOKEN_ID_KEYS.items() if key in meta})
    config["torch_dtype"] = "float32"  # every tensor is dequantized to float32
    return config


def gguf_to_hf_config(path: str | Path) -> dict[str, Any]:
    """An HF-style config.json dict built from the GGUF metadata."""
    return _config_from_header(read_gguf_header(path))


def _hf_tensor_name(gguf_name: str) -> str | None:
    if gguf_name in _TOP_LEVEL_NAMES:
        return _TOP_LEVEL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match[2] not in _LAYER_NAMES:
        return None
    return f"model.layers.{match[1]}.{_LAYER_NAMES[match[2]]}.{match[3]}"


def _unpermute_rope_rows(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: within each head it interleaves the two rotary halves.

    The converter viewed rows as (head, half, pair) and swapped the last two; viewing them as
    (head, pair, half) and swapping back restores HF's order. Works for weights and biases alike.
    """
    rows = tensor.shape[0]
    halves = tensor.reshape(num_heads, rows // num_heads // 2, 2, *tensor.shape[1:])
    return halves.transpose(1, 2).reshape(tensor.shape)


def _dequantized(data: np.ndarray, info: GGUFTensorInfo) -> torch.Tensor:
    raw = data[info.offset : info.offset + info.nbytes]
    rows = int(np.prod(info.shape[:-1]))
    values = dequantize(raw.reshape(rows, -1), info.ggml_type)
    if not values.flags.writeable:  # F32 comes back as a view of the read-only map
        values = values.copy()
    return torch.from_numpy(values.astype(np.float32, copy=False)).reshape(info.shape)


def iter_gguf_tensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor in HF shape) for every tensor of the file, one at a time."""
    header = read_gguf_header(path)
    arch = _arch_of(header)
    hf_names = {info.name: _hf_tensor_name(info.name) for info in header.tensors}
    unknown = sorted(name for name, hf_name in hf_names.items() if hf_name is None)
    if unknown:  # checked before any work: a half-loaded model is worse than none
        raise ValueError(f"GGUF file {header.path} has tensors with no HF mapping: {unknown}")

    config = _config_from_header(header)
    heads_for = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    data = np.memmap(header.path, dtype=np.uint8, mode="r")
    for info in header.tensors:
        tensor = _dequantized(data, info)
        kind = info.name.split(".")[2] if info.name.startswith("blk.") else None
        if arch.permuted_qk and kind in heads_for:
            tensor = _unpermute_rope_rows(tensor, heads_for[kind])
        yield hf_names[info.name], tensor


def gguf_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """The file's tokenizer; see `gguf_bpe_tokenizer.py` (imported lazily: it pulls in transformers)."""
    from mlaserve.loader.gguf_bpe_tokenizer import build_gguf_tokenizer

    return build_gguf_tokenizer(path)
