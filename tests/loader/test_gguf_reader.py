"""GGUF config and tensors: SmolLM2 against transformers' GGUF loader, tiny synthetic files for the rest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from mlaserve.loader.gguf_reader import gguf_to_hf_config, iter_gguf_tensors

SMOLLM_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "rms_norm_eps": 1e-05,
    "rope_theta": 100000.0,
    "max_position_embeddings": 8192,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
    "torch_dtype": "float32",
}

# A tiny llama: 4 heads of 16, 2 kv heads, so a wrong q/k row order cannot go unnoticed.
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 64, 4, 2, 16, 96, 40


def test_smollm_config(smollm_path: Path) -> None:
    assert gguf_to_hf_config(smollm_path) == SMOLLM_CONFIG


CHECKED_LAYERS = 3


class _FewLayersReader(gguf.GGUFReader):
    """transformers dequantizes every tensor it is handed; handing it a few layers keeps this test fast."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        first_layers = tuple(f"blk.{i}." for i in range(CHECKED_LAYERS))
        self.tensors = [t for t in self.tensors if t.name.startswith(first_layers) or "blk." not in t.name]


@pytest.fixture(scope="module")
def transformers_tensors(smollm_path: Path) -> dict[str, torch.Tensor]:
    """transformers' own dequantized SmolLM2 tensors (embedding, final norm, three layers)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # Only its parameter names are used, to map GGUF names to HF ones; transformers walks every submodule
    # for that, so the model gets just the layers checked.
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**{**SMOLLM_CONFIG, "num_hidden_layers": CHECKED_LAYERS}))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", _FewLayersReader)
        return load_gguf_checkpoint(str(smollm_path), return_tensors=True, model_to_load=model)["tensors"]


@pytest.mark.slow
def test_smollm_tensors_match_transformers(
    smollm_path: Path, transformers_tensors: dict[str, torch.Tensor]
) -> None:
    assert len(transformers_tensors) == 2 + CHECKED_LAYERS * 9  # embedding, final norm, 9 per layer
    names = []
    for name, tensor in iter_gguf_tensors(smollm_path):
        names.append(name)
        if name in transformers_tensors:
            expected = transformers_tensors[name]
            assert tensor.dtype == torch.float32 and tensor.shape == expected.shape, name
            torch.testing.assert_close(tensor, expected, rtol=0, atol=1e-6, msg=name)
    assert set(transformers_tensors) <= set(names)
    assert len(names) == len(set(names)) == 2 + 30 * 9
    assert "lm_head.weight" not in names  # tied to the embedding


def _llama_metadata(arch: str = "llama") -> dict[str, Any]:
    return {
        f"{arch}.embedding_length": HIDDEN,
        f"{arch}.feed_forward_length": FFN,
        f"{arch}.block_count": 1,
        f"{arch}.attention.head_count": HEADS,
        f"{arch}.attention.head_count_kv": KV_HEADS,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{arch}.rope.freq_base": 10000.0,
        f"{arch}.context_length": 256,
        f"{arch}.vocab_size": VOCAB,
    }


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows (written independently, from its description)."""
    head_dim = weight.shape[0] // num_heads
    per_head = weight.reshape(num_heads, 2, head_dim // 2, *weight.shape[1:])
    return per_head.swapaxes(1, 2).reshape(weight.shape)


def _hf_llama_weights(rng: np.random.Generator) -> dict[str, np.ndarray]:
    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    return {
        "model.embed_tokens.weight": rand(VOCAB, HIDDEN),
        "model.layers.0.input_layernorm.weight": rand(HIDDEN),
        "model.layers.0.self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, HIDDEN),
        "model.layers.0.self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
        "model.layers.0.self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
        "model.layers.0.self_attn.o_proj.weight": rand(HIDDEN, HEADS * HEAD_DIM),
        "model.layers.0.post_attention_layernorm.weight": rand(HIDDEN),
        "model.layers.0.mlp.gate_proj.weight": rand(FFN, HIDDEN),
        "model.layers.0.mlp.up_proj.weight": rand(FFN, HIDDEN),
        "model.layers.0.mlp.down_proj.weight": rand(HIDDEN, FFN),
        "model.norm.weight": rand(HIDDEN),
        "lm_head.weight": rand(VOCAB, HIDDEN),
    }


_GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.layers.0.input_layernorm.weight": "blk.0.attn_norm.weight",
    "model.layers.0.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "model.layers.0.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "model.layers.0.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "model.layers.0.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "model.layers.0.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "model.layers.0.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "model.layers.0.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "model.layers.0.mlp.down_proj.weight": "blk.0.ffn_down.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_synthetic_round_trip_undoes_rope_permute(gguf_writer: Any, arch: str) -> None:
    hf = _hf_llama_weights(np.random.default_rng(0))
    if arch == "qwen2":
        for proj in ("q_proj", "k_proj", "v_proj"):
            rows = hf[f"model.layers.0.self_attn.{proj}.weight"].shape[0]
            hf[f"model.layers.0.self_attn.{proj}.bias"] = np.arange(rows, dtype=np.float32)
    stored = {}
    for name, array in hf.items():
        if name.endswith(".bias"):
            gguf_name = _GGUF_NAMES[name.replace(".bias", ".weight")].replace(".weight", ".bias")
        else:
            gguf_name = _GGUF_NAMES[name]
        if arch == "llama" and "attn_q" in gguf_name:
            array = _llama_cpp_permute(array, HEADS)
        if arch == "llama" and "attn_k" in gguf_name:
            array = _llama_cpp_permute(array, KV_HEADS)
        stored[gguf_name] = array
    path = gguf_writer(f"{arch}.gguf", arch, _llama_metadata(arch), tensors=stored)

    loaded = dict(iter_gguf_tensors(path))
    assert sorted(loaded) == sorted(hf)
    for name, expected in hf.items():
        torch.testing.assert_close(loaded[name], torch.from_numpy(expected), rtol=0, atol=0, msg=name)

    config = gguf_to_hf_config(path)
    assert config["tie_word_embeddings"] is False
    assert config["architectures"] == ["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"]
    assert config.get("attention_bias", False) is (arch == "qwen2")
    assert "head_dim" not in config  # 64 / 4 == 16: nothing to say


@pytest.mark.parametrize(
    ("quant", "atol"), [(gguf.GGMLQuantizationType.Q8_0, 0.05), (gguf.GGMLQuantizationType.Q4_1, 0.35)]
)
def test_quantized_tensors_dequantize_like_gguf(
    gguf_writer: Any, quant: gguf.GGMLQuantizationType, atol: float
) -> None:
    weight = np.random.default_rng(1).standard_normal((VOCAB, HIDDEN)).astype(np.float32)
    path = gguf_writer(
        "q8.gguf", "llama", _llama_metadata(), tensors={"token_embd.weight": weight}, quant=quant
    )
    (name, tensor), *rest = list(iter_gguf_tensors(path))
    expected = gguf.quants.dequantize(gguf.quants.quantize(weight, quant), quant)
    assert name == "model.embed_tokens.weight" and not rest
    torch.testing.assert_close(tensor, torch.from_numpy(expected), rtol=0, atol=0)
    torch.testing.assert_close(tensor, torch.from_numpy(weight), rtol=0, atol=atol)  # and near the original


def test_head_dim_from_key_length(gguf_writer: Any) -> None:
    metadata = {**_llama_metadata(), "llama.attention.key_length": 32, "llama.rope.dimension_count": 32}
    assert gguf_to_hf_config(gguf_writer("hd.gguf", "llama", metadata))["head_dim"] == 32


def test_vocab_size_falls_back_to_token_count(gguf_writer: Any) -> None:
    metadata = {**_llama_metadata(), "tokenizer.ggml.tokens": ["a", "b", "c"]}
    del metadata["llama.vocab_size"]
    assert gguf_to_hf_config(gguf_writer("v.gguf", "llama", metadata))["vocab_size"] == 3


def test_unknown_tensor_names_are_an_error(gguf_writer: Any) -> None:
    tensors = {"token_embd.weight": np.zeros((VOCAB, HIDDEN)), "blk.0.mystery.weight": np.zeros(HIDDEN)}
    path = gguf_writer("odd.gguf", "llama", _llama_metadata(), tensors=tensors)
    with pytest.raises(ValueError, match=r"blk\.0\.mystery\.weight"):
        next(iter_gguf_tensors(path))


def test_unsupported_architecture(gguf_writer: Any) -> None:
    path = gguf_writer("mamba.gguf", "mamba", {"mamba.block_count": 1})
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'mamba'"):
        gguf_to_hf_config(path)


def test_missing_metadata_is_named(gguf_writer: Any) -> None:
    metadata = _llama_metadata()
    del metadata["llama.feed_forward_length"]
    with pytest.raises(ValueError, match="llama.feed_forward_length"):
        gguf_to_hf_config(gguf_writer("m.gguf", "llama", metadata))


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF file"):
        gguf_to_hf_config(path)
