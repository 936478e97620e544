"""Weight, config and tokenizer readers: HF safetensors folders and GGUF files."""

from mlaserve.loader.gguf_reader import gguf_to_hf_config, gguf_tokenizer, iter_gguf_tensors
from mlaserve.loader.model_files import ModelFiles, default_model_path, resolve_model
from mlaserve.loader.safetensors_reader import iter_safetensors
from mlaserve.loader.tokenizer import load_tokenizer

__all__ = [
    "ModelFiles",
    "default_model_path",
    "gguf_to_hf_config",
    "gguf_tokenizer",
    "iter_gguf_tensors",
    "iter_safetensors",
    "load_tokenizer",
    "resolve_model",
]
