"""The tokenizer of a resolved model, from its HF folder or from the GGUF metadata."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlaserve.loader.model_files import ModelFiles

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# any one of these lets AutoTokenizer build a tokenizer without the hub
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def load_tokenizer(files: ModelFiles, hf_config: object | None = None) -> PreTrainedTokenizerBase:
    """An HF tokenizer for the model; never touches the network. hf_config: the config the engine already read
    (read again from files otherwise)."""
    if files.kind == "gguf":
        from mlaserve.loader.gguf_bpe_tokenizer import build_gguf_tokenizer

        return build_gguf_tokenizer(files.path)

    if not any((files.path / name).is_file() for name in _TOKENIZER_FILES):
        raise FileNotFoundError(
            f"model folder {files.path} has no tokenizer files (expected one of {list(_TOKENIZER_FILES)})"
        )
    from transformers import AutoTokenizer  # slow import, and only this branch needs it

    from mlaserve.config.model_config import hf_config_from_dict

    # The config as the engine reads it (its fallbacks included): AutoTokenizer would otherwise read config.json
    # itself and fail on a model type this transformers has no class for.
    if hf_config is None and files.config_dict.get("model_type"):
        hf_config = hf_config_from_dict(files.config_dict)
    options = {} if hf_config is None else {"config": hf_config}
    return AutoTokenizer.from_pretrained(str(files.path), local_files_only=True, **options)
