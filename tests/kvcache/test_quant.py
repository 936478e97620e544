"""8-bit latent rows: round trip error, byte layout, and an engine run on an 8-bit cache."""

import pytest
import torch

from mlaserve import LLM, SamplingParams
from mlaserve.kvcache.quant import QUANTIZED, dequantize_rows, quantize_rows, resolve_cache_dtype, row_width
from mlaserve.testing.tiny_models import build_tiny, config_dict


@pytest.mark.parametrize("name, rel_err", [("fp8_e4m3", 0.07), ("int8", 0.01)])
def test_round_trip_error_is_bounded_per_row(name, rel_err):
    dtype = QUANTIZED[name]
    x = torch.randn(50, 576) * torch.logspace(-3, 2, 50)[:, None]  # rows of very different ranges
    rows = quantize_rows(x, dtype)
    assert rows.shape == (50, 592) and rows.dtype == dtype
    back = dequantize_rows(rows, torch.float32)
    err = (back - x).abs().amax(-1) / x.abs().amax(-1)
    assert err.max() < rel_err


def test_layout_and_validation():
    assert row_width(576, torch.float8_e4m3fn) == 592 and row_width(576, torch.bfloat16) == 576
    assert resolve_cache_dtype("auto", torch.bfloat16, True) == torch.bfloat16
    with pytest.raises(ValueError, match="only supported for MLA"):
        resolve_cache_dtype("int8", torch.bfloat16, False)
    with pytest.raises(ValueError, match="unknown kv_cache_dtype 'fp4'"):
        resolve_cache_dtype("fp4", torch.bfloat16, True)


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "int8"])
def test_engine_on_an_8bit_latent_cache(tmp_path, kv_dtype):
    path = build_tiny("deepseek_v3", tmp_path)
    cfg = config_dict(path)
    prompts = [{"prompt_token_ids": [5, 9, 11, 40, 7, 8, 100]}, {"prompt_token_ids": list(range(3, 40))}]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    full = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=32)
    small = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=32, kv_cache_dtype=kv_dtype)
    row = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    assert small.stats()["kv_bytes_per_token"] == cfg["num_hidden_layers"] * (row + 16)
    want = full.generate(prompts, params, use_tqdm=False)
    got = small.generate(prompts, params, use_tqdm=False)
    for w, g in zip(want, got):
        # The first token comes from a prefill over dequantized rows; its logprob moves only slightly.
        assert g.outputs[0].token_ids[0] == w.outputs[0].token_ids[0]
        first = w.outputs[0].token_ids[0]
        assert abs(g.outputs[0].logprobs[0][first].logprob - w.outputs[0].logprobs[0][first].logprob) < 0.05
    assert small.stats()["kv_blocks_used"] == 0
