"""The GPU's check that the weights fit builds each model on the meta device first (executor/load_model.py): every
architecture must build there, rotary tables included."""

import pytest
import torch

from mlaserve.testing.tiny_models import CONFIGS, build_tiny


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_model_can_be_sized_on_the_meta_device(tmp_path, name):
    """The GPU's memory check builds the model on the meta device first: every architecture must build there."""
    from transformers import AutoConfig

    from mlaserve.models.base import ModelInit
    from mlaserve.models.registry import get_model_class
    from mlaserve.testing.tiny_models import config_dict

    config = config_dict(build_tiny(name, tmp_path / name))
    with torch.device("meta"):
        model = get_model_class(config["architectures"][0])(ModelInit(AutoConfig.for_model(**config), None))
    assert all(p.is_meta for p in model.parameters())
