"""A float checkpoint rewritten in DeepSeek's block-FP8 layout (what DeepSeek-V3/R1 publish), and the same model
with every quantized weight replaced by what its FP8 bytes stand for: the reference transformers runs.

DeepSeek's layout: each projection's `weight` is float8_e4m3fn, beside it a float32 `weight_scale_inv` with one
value per 128x128 block (partial blocks at the edges); embeddings, norms, the router gate, its correction bias,
the LM head and the indexer's head weights stay in the model's dtype; the tensors are spread over shards listed by
`model.safetensors.index.json`; config.json's quantization_config names the format.
"""

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from mlaserve.layers.block_fp8 import dequantize, quantize

# the linear layers DeepSeek stores in FP8 (by the last part of the module name)
FP8_PROJECTIONS = (
    "q_proj",
    "q_a_proj",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_b_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "wq_b",
    "wk",
    # Llama-family names, for online-quantization comparisons on other models
    "k_proj",
    "v_proj",
)
SECTION = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}


def is_fp8_weight(name: str, tensor: torch.Tensor) -> bool:
    parts = name.split(".")
    return tensor.dim() == 2 and parts[-1] == "weight" and len(parts) > 1 and parts[-2] in FP8_PROJECTIONS


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    return tensors


def _copy_side_files(source: Path, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.suffix != ".safetensors" and path.name != "model.safetensors.index.json" and path.is_file():
            shutil.copy(path, folder / path.name)


def save_block_fp8(
    source: Path,
    folder: Path,
    num_shards: int = 3,
    section: dict | None = None,
    other_dtype: torch.dtype | None = torch.bfloat16,
) -> Path:
    """`source` (a float safetensors checkpoint) rewritten into `folder` in DeepSeek's block-FP8 layout; the
    tensors that stay unquantized are stored as other_dtype (DeepSeek's bf16; None keeps the source's)."""
    _copy_side_files(source, folder)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in _tensors(source).items():
        if is_fp8_weight(name, tensor):
            q, scale = quantize(tensor)
            out[name], out[name + "_scale_inv"] = q, scale.contiguous()
        else:
            keep = other_dtype is None or not tensor.is_floating_point()
            out[name] = tensor if keep else tensor.to(other_dtype)
    names = list(out)
    weight_map = {}
    for i in range(num_shards):
        shard = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: out[n].contiguous() for n in names[i::num_shards]}
        save_file(part, str(folder / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in out.values())}}
    (folder / "model.safetensors.index.json").write_text(json.dumps({**index, "weight_map": weight_map}))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = section or SECTION
    if other_dtype is not None:
        config["torch_dtype"] = str(other_dtype).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def save_dequantized(fp8_folder: Path, folder: Path) -> Path:
    """The FP8 checkpoint's model as a float32 checkpoint (each FP8 weight times its block scales), without the
    quantization_config: what transformers runs as the reference."""
    _copy_side_files(fp8_folder, folder)
    tensors = _tensors(fp8_folder)
    out = {}
    for name, tensor in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        scale = tensors.get(name + "_scale_inv")
        out[name] = dequantize(tensor, scale, 128) if scale is not None else tensor.float()
    save_file(out, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config.pop("quantization_config", None)
    config["torch_dtype"] = "float32"
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder
