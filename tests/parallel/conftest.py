"""Tiny models shared by the tensor-parallel tests, built once per session."""

import pytest

from mlaserve.testing.tiny_models import build_tiny


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """tiny(name) -> the folder of a tiny random model saved by transformers (mlaserve/testing/tiny_models.py)."""
    built = {}

    def get(name: str):
        if name not in built:
            built[name] = build_tiny(name, tmp_path_factory.mktemp(name))
        return built[name]

    return get
