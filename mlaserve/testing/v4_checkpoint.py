"""A float DeepSeek-V4 checkpoint rewritten the way DeepSeek publishes V4-Flash, and the same model with every
quantized weight replaced by what its bytes stand for: the reference transformers runs.

The published layout: DeepSeek's own tensor names (layers.N.attn.wq_a.weight, embed.weight, head.weight,
hc_head_fn; no `model.` prefix); the attention's wq_a / wq_b / wkv / wo_a / wo_b, the indexer's wq_b and the shared
expert's w1 / w2 / w3 in float8_e4m3fn with a float8_e8m0fnu `.scale` per 128x128 block (powers of two: scale_fmt
ue8m0); each routed expert's w1 / w2 / w3 in MXFP4, an int8 `.weight` [out, in / 2] of packed e2m1 pairs (low nibble
first) with a float8_e8m0fnu `.scale` [out, in / 32]; the compressors, the indexer's weights_proj, the router,
norms, sinks and hyper-connection weights as they were. config.json gains a block-FP8 quantization_config with
scale_fmt ue8m0 and a top-level expert_dtype "fp4".
"""

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from mlaserve.layers import block_fp8, mxfp4

FP8_WEIGHT = re.compile(
    r"\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b|ffn\.shared_experts\.w[123]|e_proj|h_proj)\.weight$"
)  # e_proj, h_proj: an MTP layer's own projections (mtp.0.*)
FP4_WEIGHT = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")
SECTION = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "scale_fmt": "ue8m0",
    "weight_block_size": [128, 128],
}
_TOP_LEVEL = {"model.embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight"}


def published_name(name: str) -> str:
    """DeepSeek's name for a tensor as transformers saves it."""
    name = _TOP_LEVEL.get(name, name)
    return name.removeprefix("model.").replace("hc_head.hc_", "hc_head_")


def quantize_fp8_ue8m0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float8_e8m0fnu scales) in 128x128 blocks, each scale its block's largest magnitude
    over the FP8 maximum rounded up to a power of two."""
    _, scale = block_fp8.quantize(w)
    scale = torch.exp2(torch.ceil(torch.log2(scale)))
    full = block_fp8.expand_scale(scale, w.shape[0], w.shape[1], block_fp8.BLOCK_N)
    q = (w.float() / full).clamp(-block_fp8.FP8_MAX, block_fp8.FP8_MAX).to(block_fp8.FP8)
    return q, scale.to(torch.float8_e8m0fnu)


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


def save_v4_published(source: Path, folder: Path, num_shards: int = 2) -> Path:
    """`source` (a float V4 checkpoint as transformers saves it) rewritten into `folder` in V4-Flash's layout."""
    _copy_side_files(source, folder)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in _tensors(source).items():
        name = published_name(name)
        stem = name.removesuffix(".weight")
        if FP8_WEIGHT.search(name):
            out[name], out[stem + ".scale"] = quantize_fp8_ue8m0(tensor)
        elif FP4_WEIGHT.search(name):
            packed, exponents = mxfp4.quantize(tensor)
            out[name] = packed.view(torch.int8)
            out[stem + ".scale"] = exponents.view(torch.float8_e8m0fnu)
        else:
            out[name] = tensor
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
    config["quantization_config"] = dict(SECTION)
    config["expert_dtype"] = "fp4"
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def dequantized(quantized: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The float32 weight a published tensor stands for (itself where it has no scales)."""
    tensor, scale = quantized[name], quantized.get(name.removesuffix(".weight") + ".scale")
    if scale is None:
        return tensor
    if tensor.dtype == block_fp8.FP8:
        return block_fp8.dequantize(tensor, scale.float(), block_fp8.BLOCK_N)
    return mxfp4.dequantize(tensor, scale)


def save_dequantized_v4(published: Path, source: Path, folder: Path) -> Path:
    """The published checkpoint's model under the source's names and config, every quantized weight dequantized
    to float32: what transformers runs as the reference."""
    _copy_side_files(source, folder)
    quantized = _tensors(published)
    out = {name: dequantized(quantized, published_name(name)) for name in _tensors(source)}
    save_file(out, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder
