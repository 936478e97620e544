"""The MLA saving a rank reports (stats' mha_kv_bytes_per_token, the start-up report's "per-head K/V would take"
line) compares like with like: under tensor parallelism every rank caches the whole latent row but would cache only
its own heads' K/V, as mla_disable does there, so the per-head figure is the rank's heads', not the model's."""

import pytest
import torch
from transformers import AutoConfig

from mlaserve.models.base import ModelInit
from mlaserve.models.registry import get_model_class
from mlaserve.parallel import ParallelContext
from mlaserve.testing.tiny_models import config_dict


@pytest.mark.parametrize("size", [1, 2, 4])
def test_per_head_cost_is_what_mla_disable_caches_on_the_rank(tiny, size: int) -> None:
    config = config_dict(tiny("deepseek_v3"))
    cls = get_model_class(config["architectures"][0])

    def spec(mla_disable: bool):
        init = ModelInit(
            AutoConfig.for_model(**config), None, ParallelContext(0, size), mla_disable=mla_disable
        )
        with torch.device("meta"):
            return cls(init).kv_cache_spec()

    latent, expanded = spec(False), spec(True)
    assert latent.mha_bytes_per_token(torch.bfloat16) == expanded.bytes_per_token(torch.bfloat16)
