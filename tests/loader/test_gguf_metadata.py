"""Our GGUF header parser against gguf.GGUFReader, on a small file holding every value type."""

from __future__ import annotations

from typing import Any

import gguf
import numpy as np
import pytest

from mlaserve.loader.gguf_metadata import read_gguf_header


def test_header_matches_gguf_reader(gguf_writer: Any) -> None:
    metadata = {
        "general.name": "tiny ✓",
        "llama.block_count": 2,
        "llama.rope.freq_base": 1e-5,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.tokens": ["a", "ü", "<|x|>", ""],
        "tokenizer.ggml.token_type": [1, 1, 3, 4],
    }
    tensors = {
        "token_embd.weight": np.ones((5, 32), dtype=np.float32),
        "output_norm.weight": np.arange(32, dtype=np.float32),
        "blk.0.attn_q.weight": np.zeros((64, 32), dtype=np.float32),
    }
    path = gguf_writer("tiny.gguf", "llama", metadata, tensors=tensors, quant=gguf.GGMLQuantizationType.Q8_0)

    header = read_gguf_header(path)
    reader = gguf.GGUFReader(path)
    assert header.architecture == "llama"
    for key, value in metadata.items():
        assert header.metadata[key] == value, key  # float32 1e-5 comes back as 1e-05, not 9.99999e-06
        assert reader.fields[key].contents() == pytest.approx(value), key
    assert [t.name for t in header.tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(header.tensors, reader.tensors):
        assert ours.ggml_type == theirs.tensor_type
        assert ours.offset == theirs.data_offset and ours.nbytes == theirs.n_bytes
        assert ours.shape == tuple(int(d) for d in reversed(theirs.shape))


def test_rejects_other_files(tmp_path: Any) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGUF" + (7).to_bytes(4, "little") + bytes(16))
    with pytest.raises(ValueError, match="version 7"):
        read_gguf_header(path)
