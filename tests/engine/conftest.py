"""Tiny models shared by the engine tests, built once per test module."""

import pytest

from mlaserve.testing.mtp_checkpoint import add_mtp_layer
from mlaserve.testing.tiny_models import build_tiny


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return build_tiny("deepseek_v3", tmp_path_factory.mktemp("ds3"))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_tiny("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def mtp_models(deepseek, tmp_path_factory) -> dict:
    """For the captured-step speculation tests: a random MTP layer (drafts mostly rejected) and the echo layer
    (drafts held), each with its plain tokens."""
    from tests.engine.test_speculative_mtp import GREEDY, generate, prompts, tokens

    out = {}
    for echo in (False, True):
        path = add_mtp_layer(deepseek, tmp_path_factory.mktemp(f"mtp_{echo}"), echo=echo)
        out[echo] = path, tokens(generate(path, prompts(), GREEDY)[0])
    return out
