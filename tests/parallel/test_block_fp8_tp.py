"""A DeepSeek block-FP8 checkpoint at tensor parallelism 2 on gloo: the same tokens and logprobs as one process,
the experts split over ranks by their width (blocks of 128 columns kept whole) and by expert (expert parallel);
and a split that would cut a scale block refused with the widths named."""

from pathlib import Path

import pytest

from mlaserve import LLM
from mlaserve.testing.fp8_checkpoint import save_block_fp8
from mlaserve.testing.tiny_models import build_tiny
from tests.parallel.test_tensor_parallel import OPTIONS, assert_same, run

pytestmark = pytest.mark.slow

# Rows off the 128 blocks (hidden 224, q_lora 96, kv_lora 40) and, where ranks split columns, whole blocks per rank
# (o_proj 4 x 64, experts and the dense MLP 256 wide).
TP_FRIENDLY = dict(
    hidden_size=224,
    q_lora_rank=96,
    kv_lora_rank=40,
    v_head_dim=64,
    intermediate_size=256,
    moe_intermediate_size=256,
)


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("fp8_tp")
    return save_block_fp8(build_tiny("deepseek_v3", tmp / "src", **TP_FRIENDLY), tmp / "fp8")


@pytest.mark.parametrize("options", [{}, {"enable_expert_parallel": True}], ids=["tp2", "ep2"])
def test_fp8_checkpoint_at_tp2_matches_one_process(fp8_model, options):
    assert_same(run(fp8_model), run(fp8_model, tensor_parallel_size=2, **options))


def test_a_split_that_cuts_a_scale_block_is_refused(tmp_path):
    src = build_tiny("deepseek_v3", tmp_path / "src", **{**TP_FRIENDLY, "moe_intermediate_size": 80})
    folder = save_block_fp8(src, tmp_path / "fp8")
    message = r"moe_intermediate_size \(80\) split over 2 ranks gives 40 columns per rank, which cuts"
    with pytest.raises(ValueError, match=message):
        LLM(str(folder), **OPTIONS, tensor_parallel_size=2)
