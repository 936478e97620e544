"""A tiny DeepSeek-V3 checkpoint turned into a DeepSeek-V3.2 one: the same weights plus a random lightning indexer in
every layer, named as transformers' DeepseekV32 saves them (self_attn.indexer.wq_b, wk, k_norm, weights_proj).

For machines whose transformers has DeepseekV3 but no DeepseekV32 classes (the GPU image): there the engine's own
backends and layouts are compared with one another, not with transformers, so random indexer weights suffice.
"""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def add_indexer(
    source: Path, folder: Path, topk: int, num_heads: int = 16, head_dim: int = 32, seed: int = 5
) -> Path:
    """`source` (a float single-file DeepSeek-V3 checkpoint) copied to `folder` as DeepSeek-V3.2 with an indexer of
    num_heads x head_dim keeping the topk best tokens. Sixteen heads by default: with few heads, scores of exactly
    zero (every head's ReLU at 0) tie often, and a tie may be broken differently by another kernel."""
    config = json.loads((source / "config.json").read_text())
    if config.get("model_type") != "deepseek_v3" or not config.get("q_lora_rank"):
        raise ValueError(
            f"{source}: add_indexer takes a DeepSeek-V3 checkpoint with q_lora_rank (the indexer's queries "
            f"come from the low-rank query); got model_type {config.get('model_type')!r}"
        )
    if head_dim < config["qk_rope_head_dim"]:
        raise ValueError(
            f"head_dim={head_dim}: the indexer rotates qk_rope_head_dim={config['qk_rope_head_dim']}"
        )
    folder.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.suffix != ".safetensors" and path.is_file():
            (folder / path.name).write_bytes(path.read_bytes())
    tensors = load_file(str(source / "model.safetensors"))
    hidden, q_lora = config["hidden_size"], config["q_lora_rank"]
    gen = torch.Generator().manual_seed(seed)
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}.self_attn.indexer."
        tensors |= {
            prefix + "wq_b.weight": torch.randn(num_heads * head_dim, q_lora, generator=gen) / q_lora**0.5,
            prefix + "wk.weight": torch.randn(head_dim, hidden, generator=gen) / hidden**0.5,
            prefix + "k_norm.weight": 0.5 + torch.rand(head_dim, generator=gen),
            prefix + "k_norm.bias": 0.1 * torch.randn(head_dim, generator=gen),
            prefix + "weights_proj.weight": torch.randn(num_heads, hidden, generator=gen) / hidden**0.5,
        }
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config |= {
        "architectures": ["DeepseekV32ForCausalLM"],
        "model_type": "deepseek_v32",
        "index_topk": topk,
        "index_n_heads": num_heads,
        "index_head_dim": head_dim,
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder
