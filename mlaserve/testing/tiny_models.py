"""Tiny random checkpoints written with transformers' save_pretrained, plus a word-level or byte tokenizer to match.

Shared by the model, engine and API tests and by the benchmarks that need a model without a download: the reference
classes are transformers' own, never ours. It lives in the package, not under tests/, so a benchmark run from any
directory imports it like the rest of mlaserve.
"""

import json
from pathlib import Path

import torch

VOCAB = 256

COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, max_position_embeddings=512, initializer_range=0.1
)

MLA = dict(
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_rope_head_dim=16,
    qk_nope_head_dim=16,
    v_head_dim=24,
    intermediate_size=96,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
)

YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "beta_fast": 32,
    "beta_slow": 1,
}

CONFIGS: dict[str, tuple[str, dict]] = {
    "deepseek_v2": ("DeepseekV2", dict(MLA, q_lora_rank=None, topk_method="greedy", n_group=1, topk_group=1)),
    "deepseek_v2_group": (
        "DeepseekV2",
        dict(
            MLA,
            q_lora_rank=48,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=1.5,
        ),
    ),
    # rms_norm_eps far from 1e-6: the latent norms keep DeepSeek's fixed 1e-6, the layer norms take the config's
    "deepseek_v2_eps": ("DeepseekV2", dict(MLA, q_lora_rank=48, n_group=1, topk_group=1, rms_norm_eps=1e-2)),
    "deepseek_v3": (
        "DeepseekV3",
        dict(MLA, q_lora_rank=48, n_group=4, topk_group=2, routed_scaling_factor=2.5),
    ),
    # 16 indexer heads: with few heads, index scores of exactly 0 (every head's ReLU at 0) are common, and such
    # ties in the top-k make transformers' own cached and uncached paths pick different tokens.
    "deepseek_v32": (
        "DeepseekV32",
        dict(
            MLA,
            q_lora_rank=48,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            index_topk=8,
            index_n_heads=16,
            index_head_dim=32,
        ),
    ),
    # One layer of each attention kind (window 16; compressed entries of rate 8; rate-4 entries picked by an
    # indexer keeping 4), a hash-routed MoE layer first. build_tiny gives the sinks, compressor biases and
    # hyper-connection biases (zero at init) and the hash table random values, so every path matters.
    "deepseek_v4": (
        "DeepseekV4",
        dict(
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=32,
            partial_rotary_factor=0.5,
            q_lora_rank=48,
            sliding_window=16,
            o_groups=2,
            o_lora_rank=24,
            layer_types=["sliding_attention", "heavily_compressed_attention", "compressed_sparse_attention"],
            mlp_layer_types=["hash_moe", "moe", "moe"],
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
            index_topk=4,
            index_n_heads=16,
            index_head_dim=32,
            hc_mult=2,
            hc_sinkhorn_iters=5,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
        ),
    ),
    "deepseek_v3_yarn_nolora": (
        "DeepseekV3",
        dict(MLA, q_lora_rank=None, n_group=1, topk_group=1, rope_scaling=YARN, max_position_embeddings=512),
    ),
    "llama": (
        "Llama",
        dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, tie_word_embeddings=False),
    ),
    "llama_tied_llama3rope": (
        "Llama",
        dict(
            num_attention_heads=4,
            num_key_value_heads=1,
            intermediate_size=96,
            tie_word_embeddings=True,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 128,
            },
        ),
    ),
    "qwen2": ("Qwen2", dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=96)),
    "mistral": (
        "Mistral",
        dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, sliding_window=None),
    ),
}


def save_word_tokenizer(path: Path, vocab_size: int = VOCAB) -> None:
    """A whitespace word-level tokenizer "w0 w1 ..." so text prompts and decoding work on random models."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    from tokenizers import decoders

    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", eos_token="w1", bos_token="w2")
    fast.save_pretrained(str(path))


BYTE_EOS, BYTE_BOS = 256, 257


def save_byte_tokenizer(path: Path) -> None:
    """A byte-level BPE with no merges (one token per UTF-8 byte, ids 0-255) plus <eos> 256 and <bos> 257: the
    layout of GPT-2-style tokenizers, which grammar libraries (structured outputs) can read."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<eos>", special=True), AddedToken("<bos>", special=True)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", bos_token="<bos>")
    fast.save_pretrained(str(path))


def build_tiny(name: str, path: Path, seed: int = 0, tokenizer: str = "word", **overrides: object) -> Path:
    """tokenizer: "word" (w0 w1 ..., VOCAB ids) or "bytes" (save_byte_tokenizer; the vocabulary grows to 260)."""
    import transformers

    family, kwargs = CONFIGS[name]
    config_cls = getattr(transformers, f"{family}Config")
    model_cls = getattr(transformers, f"{family}ForCausalLM")
    special = dict(bos_token_id=2, eos_token_id=1, pad_token_id=0)
    if tokenizer == "bytes":
        overrides = {"vocab_size": 260, **overrides}
        special = dict(bos_token_id=BYTE_BOS, eos_token_id=BYTE_EOS, pad_token_id=0)
    cfg = config_cls(**{**COMMON, **kwargs, **overrides}, **special)
    torch.manual_seed(seed)
    model = model_cls(cfg).float().eval()
    if name.startswith("deepseek_v3"):
        with torch.no_grad():  # a non-zero correction bias, so routing really depends on it
            for layer in model.model.layers:
                if hasattr(layer.mlp, "gate"):
                    layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    if name.startswith("deepseek_v4"):
        randomize_v4_extras(model, cfg)
    model.save_pretrained(str(path))
    if tokenizer == "bytes":
        save_byte_tokenizer(path)
    else:
        save_word_tokenizer(path, cfg.vocab_size)
    return path


@torch.no_grad()
def randomize_v4_extras(model, cfg) -> None:
    """transformers initialises V4's sinks, compressor position biases and hyper-connection biases to zero and
    its hash table to expert 0: random values instead, so a model that ignored any of them would differ."""
    for name, param in model.named_parameters():
        if name.endswith(("sinks", "position_bias", ".base", "hc_base")):
            param.normal_(0, 0.5)
    for name, buffer in model.named_buffers():
        if name.endswith("tid2eid"):
            buffer.copy_(torch.randint(0, cfg.n_routed_experts, buffer.shape))
        elif name.endswith("e_score_correction_bias"):
            buffer.normal_(0, 0.05)


def load_reference(path: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # greedy runs for the full length, like ignore_eos
    model.generation_config.pad_token_id = 0
    return model


def config_dict(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())
