"""A tiny DeepSeek-V3 checkpoint with a multi-token-prediction layer, named as DeepSeek-V3 ships it
(model.layers.N.*: enorm, hnorm, eh_proj, a decoder layer, shared_head.norm, and copies of embed_tokens and the LM
head as shared_head.head), for the MTP tests.

`echo=True` builds a case where drafts are known to hold: every layer's attention and MLP outputs are zero
(o_proj and down_proj), so the main model's next token is a fixed function of the current one, g(x) =
argmax head(norm(embed(x))); the MTP layer passes its embedding half straight through (eh_proj = [I | 0], unit
enorm, its head norm the model's), so it predicts g of the token it reads, which is what the main model says next.
"""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def add_mtp_layer(source: Path, folder: Path, seed: int = 7, echo: bool = False) -> Path:
    """`source` (a float single-file checkpoint) copied to `folder` with one MTP layer after its last layer and
    num_nextn_predict_layers 1; its decoder layer is the last layer's, perturbed, its own parts random."""
    folder.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.suffix != ".safetensors" and path.is_file():
            (folder / path.name).write_bytes(path.read_bytes())
    tensors = load_file(str(source / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    last, hidden = config["num_hidden_layers"] - 1, config["hidden_size"]
    gen = torch.Generator().manual_seed(seed)
    for name in [n for n in tensors if n.startswith(f"model.layers.{last}.")]:
        noise = 0.02 * torch.randn(tensors[name].shape, generator=gen)
        tensors[name.replace(f".{last}.", f".{last + 1}.", 1)] = tensors[name] + noise
    mtp = f"model.layers.{last + 1}."
    tensors |= {
        mtp + "enorm.weight": 0.5 + torch.rand(hidden, generator=gen),
        mtp + "hnorm.weight": 0.5 + torch.rand(hidden, generator=gen),
        mtp + "eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=gen) / (2 * hidden) ** 0.5,
        mtp + "shared_head.norm.weight": 0.5 + torch.rand(hidden, generator=gen),
        mtp + "shared_head.head.weight": tensors["lm_head.weight"].clone(),
        mtp + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
    }
    if echo:
        for name in tensors:
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                tensors[name] = torch.zeros_like(tensors[name])
        tensors[mtp + "enorm.weight"] = torch.ones(hidden)
        tensors[mtp + "eh_proj.weight"] = torch.cat((torch.eye(hidden), torch.zeros(hidden, hidden)), dim=1)
        tensors[mtp + "shared_head.norm.weight"] = tensors["model.norm.weight"].clone()
    tensors = {name: t.contiguous() for name, t in tensors.items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    return folder
