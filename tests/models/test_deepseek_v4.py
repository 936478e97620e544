"""DeepSeek-V4 against transformers' DeepseekV4ForCausalLM: a tiny random model with one layer of each attention
kind (a window of 16, entries compressed 8:1, entries compressed 4:1 of which an indexer keeps 4) and a hash-routed
MoE layer, with prompts and outputs longer than the window and than top-k x rate, so every path runs. Greedy tokens
over 32 steps must equal transformers' and our logprobs its teacher-forced log-softmax within 1e-4, batched, with
chunked prefill whose chunks split compression windows, preempted, and from prefix-cache hits."""

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from mlaserve import LLM, SamplingParams
from mlaserve.testing.tiny_models import build_tiny
from tests.engine.test_sliding_window import (
    check_against_reference,
    check_prefix_hits_against_reference,
    prompts,
)

OPTIONS = dict(dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    return build_tiny("deepseek_v4", tmp_path_factory.mktemp("v4"))


@pytest.mark.parametrize(
    "options",
    [
        {},
        dict(
            enable_chunked_prefill=True, max_num_batched_tokens=13
        ),  # 13: chunks end inside windows of 4 and 8
        dict(
            block_size=4, num_kv_blocks=13, max_num_batched_tokens=32, max_model_len=128
        ),  # requests preempted: num_kv_blocks sizes each group's pool; the 4:1 entries' pool holds 208 tokens
    ],
    ids=["batched", "chunked", "preempted"],
)
def test_v4_equals_transformers(v4, options):
    llm = LLM(str(v4), **{**OPTIONS, "num_kv_blocks": 256, **options})
    batch = prompts(4, seed=1, low=10, high=60)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    check_against_reference(v4, batch, outs)
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0
    if "num_kv_blocks" in options:
        assert stats["num_preemptions"] > 0


class StaticDecodeOnCPU:
    """What a captured decode step reads, run eagerly on CPU: DecodeGraphs' staging of every group's inputs into
    static buffers of `size` rows (padding rows, stale table columns, each row's entry written or sent to the null
    block) and its metadata, whose host-side lengths are all max_model_len. Only the capture itself is missing."""

    def __init__(self, runner, max_model_len: int, size: int = 8) -> None:
        from mlaserve.runner.cuda_graphs import allocate_group_inputs

        self.runner, self.size, self.max_model_len, self.steps = runner, size, max_model_len, 0
        self.host_i64 = torch.zeros(4, size, dtype=torch.long)
        self.seq_lens = torch.ones(size, dtype=torch.int32)
        self.tables = torch.zeros(size, -(-max_model_len // runner.block_size), dtype=torch.int32)
        cpu = torch.device("cpu")
        self.groups = allocate_group_inputs(runner.group_rules, size, max_model_len, runner.block_size, cpu)

    def can_run(self, batch) -> bool:
        return batch.num_decodes == len(batch.query_lens) <= self.size

    def run(self, batch, source=None, shift=None) -> torch.Tensor:
        from mlaserve.runner.cuda_graphs import (
            copy_group_inputs,
            stage_decode_inputs,
            stage_group_inputs,
            static_decode_meta,
        )

        assert source is None and shift is None  # no lookahead steps here
        r, n = self.runner, len(batch.query_lens)
        self.steps += 1
        stage_decode_inputs(batch, self.size, self.host_i64, self.seq_lens, self.tables)
        copy_group_inputs(
            self.groups, stage_group_inputs(batch, self.size, r.group_rules, r.block_size), self.size
        )
        meta = static_decode_meta(
            r.block_size, self.max_model_len, r.group_rules, self.size, self.host_i64[2], self.seq_lens,
            self.tables, self.groups,
        )  # fmt: skip
        hidden = r.model(self.host_i64[0], self.host_i64[1], r.kv_caches, meta)
        return r.model.compute_logits(hidden)[:n]


def test_v4_decode_through_the_captured_steps_inputs_equals_transformers(v4):
    llm = LLM(str(v4), **OPTIONS, block_size=4, num_kv_blocks=256, max_model_len=160)
    static = llm.engine.runner.graphs = StaticDecodeOnCPU(llm.engine.runner, 160)
    batch = prompts(3, seed=4, low=10, high=60)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    check_against_reference(v4, batch, outs)
    assert static.steps >= 31 and llm.stats()["kv_blocks_used"] == 0


def test_prefix_cache_hits_keep_v4_outputs(v4):
    # A hit ends on a block of every group: entry blocks of 4 span 16 and 32 tokens, so 32 of the 45 shared hit.
    check_prefix_hits_against_reference(v4, 45, **OPTIONS, num_kv_blocks=256, block_size=4)


def test_indexer_really_selects(v4, monkeypatch):
    """Some query must see more complete 4:1 entries than the indexer keeps, so top-k drops some."""
    from mlaserve.layers.compressor import CompressedIndexer

    dropped, real = [], CompressedIndexer.select

    def select(self, q_resid, hidden, cos, sin, keys, visible):
        kept = real(self, q_resid, hidden, cos, sin, keys, visible)
        dropped.append(int((visible.sum(-1) - kept.sum(-1)).max()))
        return kept

    monkeypatch.setattr(CompressedIndexer, "select", select)
    llm = LLM(str(v4), **OPTIONS, num_kv_blocks=64)
    llm.generate([{"prompt_token_ids": prompts(1, seed=6, low=40, high=41)[0]}], SamplingParams(max_tokens=2))
    assert max(dropped) > 0


def _renamed_hc(name: str) -> str:
    """model.layers.N.hc_attn_scale -> model.layers.N.attn_hc.scale: transformers versions before the name mapping
    on save wrote the hyper-connections under their module names."""
    return re.sub(r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2", name)


def _deepseek_names(name: str) -> str:
    renames = {"model.embed_tokens.weight": "embed.weight", "model.hc_head.hc_fn": "hc_head_fn",
               "model.hc_head.hc_base": "hc_head_base", "model.hc_head.hc_scale": "hc_head_scale"}  # fmt: skip
    return renames.get(name, name.removeprefix("model."))


@pytest.mark.parametrize("rename", [_deepseek_names, _renamed_hc], ids=["deepseek", "module-names"])
def test_other_checkpoint_spellings_load(v4, tmp_path, rename):
    """DeepSeek ships layers.N..., embed.weight, head.weight, hc_head_fn (no model. prefix) where transformers
    saves model.layers.N... and model.embed_tokens.weight; the hyper-connections' own `scale` is never read as
    a quantized weight's scale."""
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((v4 / name).read_bytes())
    tensors = {rename(k): v for k, v in load_file(v4 / "model.safetensors").items()}
    assert tensors.keys() != load_file(v4 / "model.safetensors").keys()
    save_file(tensors, tmp_path / "model.safetensors")
    batch = [{"prompt_token_ids": p} for p in prompts(2, seed=7, low=20, high=30)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(str(v4), **OPTIONS).generate(batch, params, use_tqdm=False)]
    got = LLM(str(tmp_path), **OPTIONS).generate(batch, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want


def test_kv_bytes_per_token_counts_each_rates_own_entries(v4):
    llm = LLM(str(v4), **OPTIONS, num_kv_blocks=16, max_model_len=128)
    cfg = json.loads((v4 / "config.json").read_text())
    d, i = cfg["head_dim"], cfg["index_head_dim"]
    # An entry of the 4:1 layer: its kv and indexer key; of the 8:1 layer: its kv. The window's rows (every layer's
    # kv and compressor projections) are a fixed number per request and do not count.
    sparse, heavy = (d + i) * 4, d * 4
    assert llm.stats()["kv_bytes_per_token"] == sparse / 4 + heavy / 8
    assert llm.stats()["kv_cache_groups"][1:] == [f"pooled 1:4 of group 0: {sparse} bytes/entry",
                                                  f"pooled 1:8 of group 0: {heavy} bytes/entry"]  # fmt: skip


def test_a_long_generation_holds_the_window_and_a_slot_per_ratio_tokens(v4):
    llm = LLM(
        str(v4), **OPTIONS, block_size=4, num_kv_blocks=64, max_num_batched_tokens=32, max_model_len=512
    )
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
    engine.add_request({"prompt_token_ids": prompts(1, seed=5, low=40, high=41)[0]}, params)
    most = [0, 0, 0]
    while engine.has_unfinished_requests():
        engine.step(stream=False)
        blocks = engine.stats()["kv_blocks_by_group"]
        most = [max(m, b) for m, b in zip(most, blocks, strict=True)]
    # 340 tokens: the rows group holds the window of 16 (and the step's own tokens), the entry groups a block per
    # 4 x 4 and 4 x 8 tokens. One row per token would take 85 blocks, more than the pool.
    assert most[0] <= -(-(16 + 32) // 4) + 1, most
    assert most[1:] == [-(-340 // 16), -(-340 // 32)], most
    assert llm.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"compress_rates": {"compressed_sparse_attention": 0, "heavily_compressed_attention": 8}},
            "compress",
        ),
        ({"sliding_window": 0}, "sliding_window"),
        ({"index_topk": 0}, "index_topk"),
        ({"o_groups": 3}, "o_groups"),
        ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype"),  # 8-bit V4 caches are served: an unknown name is not
    ],
)
def test_v4_configs_that_cannot_run_fail_before_weights_load(v4, tmp_path, monkeypatch, change, message):
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((v4 / name).read_bytes())
    engine = {k: change.pop(k) for k in list(change) if k == "kv_cache_dtype"}
    config = json.loads((v4 / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    loaded = []
    monkeypatch.setattr("mlaserve.executor.model_build.build_model", lambda *a, **k: loaded.append(1))
    with pytest.raises(ValueError, match=message):
        LLM(str(tmp_path), device="cpu", num_kv_blocks=16, load_format="dummy", **engine)
    assert not loaded


def test_dummy_weights_serve_a_v4_config(v4, tmp_path):
    (tmp_path / "config.json").write_bytes((v4 / "config.json").read_bytes())
    llm = LLM(
        str(tmp_path),
        **OPTIONS,
        load_format="dummy",
        skip_tokenizer_init=True,
        num_kv_blocks=32,
        max_model_len=128,
    )
    out = llm.generate([{"prompt_token_ids": [5] * 40}], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4 and llm.stats()["kv_blocks_used"] == 0


def test_transformers_without_a_v4_config_class_reads_config_json_as_spelled_out(v4, monkeypatch):
    # The GPU image's transformers may predate DeepseekV4Config: save_pretrained's config.json names every field.
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    batch = [{"prompt_token_ids": p} for p in prompts(2, seed=5, low=20, high=30)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(str(v4), **OPTIONS).generate(batch, params, use_tqdm=False)]
    monkeypatch.delitem(CONFIG_MAPPING._mapping, "deepseek_v4")
    llm = LLM(str(v4), **OPTIONS)
    assert type(llm.engine.model_config.hf_config).__name__.lower() == "pretrainedconfig"
    assert [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)] == want


def test_every_expert_weighted_by_its_routing_equals_the_routed_loop():
    """The MoE path a captured decode step takes (no device-to-host read of the picked experts) against the loop."""
    from torch import nn

    from mlaserve.models.deepseek_v4_ffn import V4MLP, run_every_expert, run_experts

    torch.manual_seed(3)
    experts = nn.ModuleList(V4MLP(16, 8, 1.5) for _ in range(6))
    x, ids = torch.randn(5, 16), torch.stack([torch.randperm(6)[:2] for _ in range(5)])
    weights = torch.rand(5, 2)
    with torch.no_grad():
        torch.testing.assert_close(
            run_every_expert(experts, x, ids, weights), run_experts(experts, x, ids, weights)
        )
