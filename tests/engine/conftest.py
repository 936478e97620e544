"""Tiny models shared by the engine tests, built once per test module."""

import pytest

from mlaserve.testing.tiny_models import build_tiny


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return build_tiny("deepseek_v3", tmp_path_factory.mktemp("ds3"))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_tiny("llama", tmp_path_factory.mktemp("llama"))
