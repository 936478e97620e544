"""What the conversion tests share: a tiny Llama (4 query heads, 2 KV heads of 16, 2 layers) and engine options."""

import pytest

from mlaserve.testing.tiny_models import build_tiny

OPTIONS = dict(dtype="float32", device="cpu", num_kv_blocks=128, max_model_len=256)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_tiny("llama", tmp_path_factory.mktemp("llama"))
