"""The tokenizer of a resolved model, from its HF folder or from the GGUF metadata."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlaserve.loader.model_files import ModelFiles

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# any one of these lets AutoTokenizer build a tokenizer without the hub
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def load_tokenizer(files: ModelFiles) -> PreTrainedTokenizerBase:
    """An HF tokenizer for the model; never touches the network."""
    if files.kind == "gguf":
        from mlaserve.loader.gguf_bpe_tokenizer import build_gguf_tokenizer

        return build_gguf_tokenizer(files.path)

    if not any((files.path / name).is_file() for name in _TOKENIZER_FILES):
        raise FileNotFoundError(
            f"model folder {files.path} has no tokenizer files (expected one of {list(_TOKENIZER_FILES)})"
        )
    from transformers import AutoTokenizer  # slow import, and only this branch needs it

    return AutoTokenizer.from_pretrained(str(files.path), local_files_only=True)
