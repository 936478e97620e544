"""load_tokenizer for both kinds of model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from mlaserve.loader.model_files import ModelFiles
from mlaserve.loader.tokenizer import load_tokenizer


def test_gguf_tokenizer(smollm_path: Path) -> None:
    tokenizer = load_tokenizer(ModelFiles(kind="gguf", path=smollm_path, config_dict={}))
    assert tokenizer("<|im_start|>user").input_ids[0] == 1


def test_hf_folder_tokenizer(tmp_path: Path) -> None:
    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"})
    )
    tokenizer = load_tokenizer(ModelFiles(kind="hf", path=tmp_path, config_dict={}))
    assert tokenizer("hello world").input_ids == [1, 2]


def test_hf_folder_without_tokenizer(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        load_tokenizer(ModelFiles(kind="hf", path=tmp_path, config_dict={}))
