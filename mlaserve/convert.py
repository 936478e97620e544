"""`mlaserve convert SRC DST`: an engine built on SRC with the latent layers asked for, its conversion written to DST
in the folder format conversion/folder.py describes (or DeepSeek-V2's, conversion/deepseek_format.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import save_file

from mlaserve.conversion.deepseek_format import check_exportable, export_deepseek_v2
from mlaserve.conversion.folder import SECTION, TENSORS
from mlaserve.conversion.mla import CALIBRATION_TEXT
from mlaserve.llm import LLM


def convert_folder(src: str, dst: str, format: str = "auto", **options: object) -> dict:
    """Convert SRC with the engine's own enable_mla path (options: mla_latent_dim, qk_rope_head_dim,
    mla_skip_layers, mla_rank_allocation, dtype, device) and write DST in `format` ("auto", "deepseek_v2",
    "mlaserve"); returns the conversion's summary (the mlaserve config section, with the format written)."""
    if format not in ("auto", "deepseek_v2", "mlaserve"):
        raise ValueError(f"format must be auto, deepseek_v2 or mlaserve, got {format!r}")

    target = Path(dst)
    if target.exists() and any(target.iterdir()):
        raise ValueError(f"{dst} exists and is not empty; give a new folder")
    source = Path(src)
    if not (source / "config.json").is_file():
        raise ValueError(f"{src} is not a Hugging Face model folder (no config.json)")
    original = json.loads((source / "config.json").read_text())
    if original.get(SECTION):
        raise ValueError(f"{src} is already a converted folder")
    # The engine calibrates on up to 2,048 tokens: a cache just large enough for one such sequence.
    length = min(2048, int(original.get("max_position_embeddings") or 2048))
    llm = LLM(src, enable_mla=True, num_kv_blocks=-(-length // 16) + 1, max_model_len=length, **options)
    model = llm.engine.executor.model
    tensors, ranks = {}, []
    for index, layer in enumerate(model.model.layers):
        if not layer.self_attn.enable_mla:
            continue
        attn = layer.self_attn.attn
        tensors[f"layers.{index}.pairs"] = attn.pairs.cpu().contiguous()
        if attn.basis is not None:
            tensors[f"layers.{index}.basis"] = attn.basis.float().cpu().contiguous()
        ranks.append(attn.latent_dim)
    stats = llm.stats()
    section = {
        "mla_latent_dim": options.get("mla_latent_dim"),
        "qk_rope_head_dim": options.get("qk_rope_head_dim"),
        "mla_skip_layers": list(options.get("mla_skip_layers") or ()),
        "mla_rank_allocation": options.get("mla_rank_allocation", "uniform"),
        "ranks": ranks,
        "kv_bytes_per_token": {
            "before": stats["mha_kv_bytes_per_token"],
            "after": stats["kv_bytes_per_token"],
        },
        "cache_dtype": stats["kv_cache_dtype"],
        "calibration": CALIBRATION_TEXT
        if options.get("mla_latent_dim") or options.get("qk_rope_head_dim")
        else None,
    }
    hf_config = llm.engine.model_config.hf_config
    if format == "deepseek_v2" or (format == "auto" and not check_exportable(hf_config, model)):
        export_deepseek_v2(
            source, target, model, hf_config, original
        )  # names what it cannot hold, if anything
        return {**section, "format": "deepseek_v2"}
    shutil.copytree(source, target, dirs_exist_ok=True)
    original[SECTION] = section
    (target / "config.json").write_text(json.dumps(original, indent=2) + "\n")
    (target / TENSORS).parent.mkdir()
    save_file(tensors, str(target / TENSORS))
    return {**section, "format": "mlaserve"}
