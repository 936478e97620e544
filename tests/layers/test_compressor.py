"""DeepSeek-V4's building blocks against transformers' own modules on fresh random weights and inputs: the
compressors (heavily compressed: one series; compressed-sparse: two overlapping series) from cached per-token
projections, and the hyper-connections around a block."""

import pytest
import torch
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

from mlaserve.layers.compressor import Compressor
from mlaserve.layers.hyper_connection import HyperConnection, HyperHead
from mlaserve.layers.rotary import RotaryEmbedding
from mlaserve.models.deepseek_v4 import v4_rope
from mlaserve.testing.tiny_models import CONFIGS


def v4_config(**overrides) -> object:
    from transformers import DeepseekV4Config

    return DeepseekV4Config(**{**CONFIGS["deepseek_v4"][1], "vocab_size": 64, "hidden_size": 32, **overrides})


@pytest.mark.parametrize("kind", ["heavily_compressed_attention", "compressed_sparse_attention"])
def test_entries_from_cached_projections_equal_transformers_compressor(kind):
    torch.manual_seed(0)
    cfg = v4_config()
    ref_cls = hf.DeepseekV4HCACompressor if kind.startswith("heavily") else hf.DeepseekV4CSACompressor
    ref = ref_cls(cfg).float().eval()
    rate = cfg.compress_rates[kind]
    mine = Compressor(cfg.hidden_size, cfg.head_dim, rate, kind.startswith("compressed"), cfg.rms_norm_eps)
    with torch.no_grad():
        for param in ref.parameters():
            param.normal_(0, 0.5)
        mine.wkv.weight.copy_(ref.kv_proj.weight)
        mine.wgate.weight.copy_(ref.gate_proj.weight)
        mine.ape.copy_(ref.position_bias)
        mine.norm.weight.copy_(ref.kv_norm.weight)
    length = 5 * rate + 3  # a partial window at the end: not an entry yet
    hidden = torch.randn(1, length, cfg.hidden_size)
    positions = torch.arange(length)[None]
    with torch.no_grad():
        if kind.startswith(
            "compressed"
        ):  # the CSA compressor also runs its indexer: only its entries are compared
            ref.indexer.forward = lambda *a, **k: torch.zeros(1, length, 1, dtype=torch.long)
        want = ref(hidden, torch.randn(1, length, cfg.q_lora_rank), positions, None, 0)[0][0, 0]
        cos, sin = RotaryEmbedding(v4_rope(cfg, "compress")).cos_sin(torch.arange(5) * rate)
        got = mine.entries(mine.state(hidden[0]), 5, cos, sin)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("overlap", [False, True], ids=["one-series", "overlapping"])
def test_entries_pooled_one_at_a_time_equal_every_entry_at_once(overlap):
    """The engine's path (pool: each entry once, from the rows of the tokens up to its last, -1 slots before the
    sequence's start) against the reference that makes every entry from the whole sequence (entries)."""
    torch.manual_seed(2)
    rate, dim, count = 4, 16, 6
    mine = Compressor(24, dim, rate, overlap, 1e-6)
    with torch.no_grad():
        for param in mine.parameters():
            param.normal_(0, 0.5)
    states = mine.state(torch.randn(count * rate + 2, 24))
    cos, sin = RotaryEmbedding(torch.rand(4)).cos_sin(torch.arange(count) * rate)
    want = mine.entries(states, count, cos, sin)
    span = 2 * rate  # the engine gathers the widest span any layer of that rate needs
    last = torch.arange(count) * rate + rate - 1
    pos = last[:, None] - span + 1 + torch.arange(span)
    windows = states[pos.clamp(min=0)]
    got = mine.pool(windows, pos >= 0, cos, sin)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    # a captured step's padding row has no token at all: its entry (sent to the null block) must not be NaN
    nothing = mine.pool(windows[:1], torch.zeros(1, span, dtype=torch.bool), cos[:1], sin[:1])
    assert torch.isfinite(nothing).all()


def test_hyper_connection_and_head_equal_transformers():
    torch.manual_seed(1)
    cfg = v4_config(hc_mult=3)
    ref, head = hf.DeepseekV4HyperConnection(cfg).float(), hf.DeepseekV4HyperHead(cfg).float()
    mine = HyperConnection(3, cfg.hidden_size, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
    mine_head = HyperHead(3, cfg.hidden_size, cfg.hc_eps, cfg.rms_norm_eps)
    with torch.no_grad():
        for module in (ref, head):
            for param in module.parameters():
                param.normal_(0, 0.3)
        mine.load_state_dict(ref.state_dict())
        mine_head.load_state_dict(head.state_dict())
        streams = torch.randn(2, 7, 3, cfg.hidden_size)
        post, comb, collapsed = ref(streams)
        got_post, got_comb, got_collapsed = mine(streams.flatten(0, 1))
        out = torch.randn(2, 7, cfg.hidden_size)
        want_merged = post.unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), streams)
        got_merged = HyperConnection.merge(streams.flatten(0, 1), out.flatten(0, 1), got_post, got_comb)
    torch.testing.assert_close(got_collapsed, collapsed.flatten(0, 1))
    torch.testing.assert_close(got_merged, want_merged.flatten(0, 1))
    torch.testing.assert_close(mine_head(streams.flatten(0, 1)), head(streams).flatten(0, 1))
