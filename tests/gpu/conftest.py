"""Fixtures the GPU tests share."""

import pytest

from mlaserve.testing.mtp_checkpoint import add_mtp_layer
from mlaserve.testing.tiny_models import build_tiny


@pytest.fixture(scope="module")
def mtp_models(tmp_path_factory) -> dict:
    """A tiny DeepSeek-V3 with an MTP layer, by whether that layer echoes (drafts that always hold) or is random."""
    plain = build_tiny("deepseek_v3", tmp_path_factory.mktemp("v3"))
    return {
        echo: add_mtp_layer(plain, tmp_path_factory.mktemp(f"mtp_{echo}"), echo=echo)
        for echo in (False, True)
    }
