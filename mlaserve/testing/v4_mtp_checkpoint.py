"""A tiny DeepSeek-V4 checkpoint with a multi-token-prediction layer under `mtp.0.*` in DeepSeek's names (the
layout models/deepseek_v4_mtp.py reads), for the V4 MTP tests.

The layer's block takes its attention from the tiny model's sliding-window layer and its MoE, norms and
hyper-connections from a score-routed layer, each perturbed; its own parts (enorm, hnorm, e_proj, h_proj, norm,
hc_head_*) are random.

`echo=True` builds a case where drafts are known to hold: every block's attention and MoE outputs are zero (wo_b and
each expert's w2), so the streams stay copies of one vector, scaled; the main model's next token is then a fixed
function of the current one, g(x) = argmax head(norm(embed(x))), since the norms do not see the scale. The MTP
layer passes its embedding half alone (e_proj = I, h_proj = 0, unit enorm, its norm the model's), so it predicts g
of the token it reads: what the main model says next.
"""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def add_v4_mtp_layer(source: Path, folder: Path, seed: int = 7, echo: bool = False) -> Path:
    """`source` (a float single-file V4 checkpoint as build_tiny saves it) copied to `folder` with one MTP layer."""
    folder.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.suffix != ".safetensors" and path.is_file():
            (folder / path.name).write_bytes(path.read_bytes())
    tensors = load_file(str(source / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    kinds = config["layer_types"]
    window_layer = kinds.index("sliding_attention")
    moe_layer = config["mlp_layer_types"].index("moe")
    hidden, hc = config["hidden_size"], config["hc_mult"]
    gen = torch.Generator().manual_seed(seed)
    for layer, parts in ((window_layer, (".attn.",)), (moe_layer, (".ffn.", "_norm.", ".hc_"))):
        prefix = f"model.layers.{layer}"
        for name in [n for n in tensors if n.startswith(prefix + ".") and any(p in n for p in parts)]:
            if layer == moe_layer and ".attn." in name:
                continue
            noise = 0.02 * torch.randn(tensors[name].shape, generator=gen)
            tensors["mtp.0" + name[len(prefix) :]] = tensors[name] + noise
    tensors |= {
        "mtp.0.enorm.weight": 0.5 + torch.rand(hidden, generator=gen),
        "mtp.0.hnorm.weight": 0.5 + torch.rand(hidden, generator=gen),
        "mtp.0.norm.weight": 0.5 + torch.rand(hidden, generator=gen),
        "mtp.0.e_proj.weight": torch.randn(hidden, hidden, generator=gen) / hidden**0.5,
        "mtp.0.h_proj.weight": torch.randn(hidden, hidden, generator=gen) / hidden**0.5,
        "mtp.0.hc_head_fn": 0.1 * torch.randn(hc, hc * hidden, generator=gen),
        "mtp.0.hc_head_base": 0.1 * torch.randn(hc, generator=gen),
        "mtp.0.hc_head_scale": torch.ones(1),
    }
    if echo:
        for name in tensors:
            if name.endswith(("wo_b.weight", "w2.weight")):
                tensors[name] = torch.zeros_like(tensors[name])
        tensors["mtp.0.enorm.weight"] = torch.ones(hidden)
        tensors["mtp.0.e_proj.weight"] = torch.eye(hidden)
        tensors["mtp.0.h_proj.weight"] = torch.zeros(hidden, hidden)
        tensors["mtp.0.norm.weight"] = tensors["model.norm.weight"].clone()
    tensors = {name: t.contiguous() for name, t in tensors.items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    return folder
