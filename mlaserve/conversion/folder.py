"""The folder `mlaserve convert SRC DST` writes (mlaserve/convert.py): a Llama/Qwen2/Mistral folder converted to MLA
once, served by `LLM(DST)` without calibrating again.

Two formats. `deepseek_v2` (what `auto` writes when every layer is converted at one rank, without attention biases
or sliding windows): a DeepSeek-V2 folder that transformers' DeepseekV2ForCausalLM loads too
(conversion/deepseek_format.py).
`mlaserve` (what `auto` writes otherwise: per-layer ranks, skipped layers, Qwen2's biases): DST holds SRC's files unchanged (the converted layers still project keys and values with the original weights; the
latent is those projections' kept rotary pairs and principal directions), plus:
  mlaserve_mla/latent.safetensors   per converted layer: the rotary pairs each KV head keeps, and the latent basis
                               (absent for an exact layer)
  config.json                  SRC's, with an `mlaserve_mla` section: the options, the ranks per layer, the KV
                               bytes per token before and after, and the calibration text
An engine that loads DST finds the section, builds the latent layers (skipping the same layers) and sets each
layer's pairs and basis from the file: the same model as the conversion's, bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from mlaserve.conversion.mla import latent_layers

SECTION = "mlaserve_mla"
TENSORS = "mlaserve_mla/latent.safetensors"  # a subfolder: the checkpoint loader reads every top-level file


def saved_conversion(config_dict: dict) -> dict | None:
    """The `mlaserve_mla` section of a converted folder's config.json, or None."""
    return config_dict.get(SECTION)


def apply_saved_conversion(model: torch.nn.Module, folder: Path) -> None:
    """Set every converted layer's rotary pairs and latent basis from DST's tensors."""
    tensors = load_file(str(folder / TENSORS))
    layers = [i for i, layer in enumerate(model.model.layers) if layer.self_attn.enable_mla]
    if len(layers) != len(latent_layers(model)) or any(f"layers.{i}.pairs" not in tensors for i in layers):
        raise ValueError(f"{folder / TENSORS} does not match the converted layers of config.json's {SECTION}")
    for i in layers:
        model.model.layers[i].self_attn.attn.convert(
            tensors[f"layers.{i}.pairs"], tensors.get(f"layers.{i}.basis")
        )
