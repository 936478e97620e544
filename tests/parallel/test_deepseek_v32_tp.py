"""DeepSeek-V3.2 over two ranks on CPU (gloo): the MLA heads split as V3's, the lightning indexer whole on every rank.
The tiny model's index_topk (8) is far below its prompts (up to 62 tokens), so the selection drops positions; the
prompts cover chunked prefill and prefix-cache hits. Greedy tokens equal one process's and logprobs agree within
1e-4 in float32, tensor or expert parallel, on an 8-bit cache (indexer keys too), from transformers' checkpoint and
from DeepSeek's block-FP8 layout of it; under torchrun every rank writes the same indexer keys and selects the same slots at every step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mlaserve import LLM
from mlaserve.testing.fp8_checkpoint import save_block_fp8
from mlaserve.testing.tiny_models import build_tiny
from tests.parallel.test_block_fp8_tp import TP_FRIENDLY
from tests.parallel.test_tensor_parallel import OPTIONS, PARAMS, REPO, assert_same, prompts

pytestmark = pytest.mark.slow

TOPK = 8  # tiny_models' deepseek_v32


@pytest.fixture
def selections(monkeypatch) -> list[tuple[int, int]]:
    """(selected slots per query, longest context) of each selection rank 0 ran (rank 0 is this process)."""
    import mlaserve.attention.sparse as sparse

    calls, real = [], sparse.select_topk

    def counting(q, weights, key_cache, meta, topk, scale):
        out = real(q, weights, key_cache, meta, topk, scale)
        calls.append((out.shape[1], max(meta.host_seq_lens)))
        return out

    monkeypatch.setattr(sparse, "select_topk", counting)
    return calls


def run(model: Path, **options: object) -> tuple[list, dict]:
    llm = LLM(str(model), **OPTIONS, **options)
    try:
        attn = llm.engine.executor.model.model.layers[0].self_attn  # rank 0's
        split = {"heads": attn.num_heads, "index_heads": attn.indexer.num_heads}
        return llm.generate(prompts(), PARAMS, use_tqdm=False), {**llm.stats(), **split}
    finally:
        llm.engine.close()


def check_two_ranks(model: Path, selections: list, **options: object) -> None:
    got, stats = run(model, tensor_parallel_size=2, **options)
    assert stats["tensor_parallel_size"] == 2 and stats["prefix_cache_hits"] > 0
    assert stats["kv_blocks_used"] == 0
    assert (stats["heads"], stats["index_heads"]) == (2, 16)  # half the attention heads, every indexer head
    assert any(k == TOPK < longest for k, longest in selections), "no step dropped positions"
    want, _ = run(model, **{k: v for k, v in options.items() if k == "kv_cache_dtype"})
    assert_same(want, got)


@pytest.mark.parametrize(
    "options",
    [{}, {"enable_expert_parallel": True}, {"kv_cache_dtype": "fp8_e4m3"}],  # 8-bit indexer keys too
    ids=["tp2", "ep2", "tp2-fp8-cache"],
)
def test_v32_over_two_ranks_gives_one_process_tokens(tiny, selections, options):
    check_two_ranks(tiny("deepseek_v32"), selections, **options)


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory) -> Path:
    """DeepSeek's block-FP8 layout: the indexer's wq_b and wk in FP8 with their weight_scale_inv, weights_proj and
    k_norm in bf16; widths that keep 128-column scale blocks whole per rank where ranks split columns."""
    tmp = tmp_path_factory.mktemp("v32_fp8_tp")
    return save_block_fp8(build_tiny("deepseek_v32", tmp / "src", **TP_FRIENDLY), tmp / "fp8")


@pytest.mark.parametrize("options", [{}, {"enable_expert_parallel": True}], ids=["tp2", "ep2"])
def test_fp8_v32_over_two_ranks_gives_one_process_tokens(fp8_model, selections, options):
    index = json.loads((fp8_model / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.0.self_attn.indexer.wq_b.weight_scale_inv" in index
    check_two_ranks(fp8_model, selections, **options)


def test_a_layout_that_does_not_divide_the_heads_is_refused(tiny):
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\).*sizes that do: 1, 2, 4"):
        LLM(str(tiny("deepseek_v32")), **OPTIONS, tensor_parallel_size=3)


# Each rank records, at every indexer call, the keys it cached this step and the slots it selected (on the host: a
# GPU rank runs eagerly, since a captured step would not call the Python forward again).
RECORDING_SCRIPT = """
import json, sys
import torch
import torch.distributed as dist
from mlaserve import LLM, SamplingParams
from mlaserve.layers.indexer import Indexer

records, forward = [], Indexer.forward

def recording(self, positions, hidden, q_resid, key_cache, meta):
    selected = forward(self, positions, hidden, q_resid, key_cache, meta)
    keys = key_cache.flatten(0, 2).index_select(0, meta.slot_mapping.clamp(min=0))
    records.append((keys.cpu(), None if selected is None else selected.cpu()))
    # rank 1 ends inside LLM(...) without the interpreter's teardown: save as it goes
    torch.save(records, f"{sys.argv[2]}/rank{dist.get_rank()}.pt")
    return selected

Indexer.forward = recording
llm = LLM(sys.argv[1], max_model_len=128, max_num_batched_tokens=48, num_kv_blocks=64, tensor_parallel_size=2,
          distributed_executor_backend="external_launcher", **json.loads(sys.argv[4]))
outs = llm.generate([{"prompt_token_ids": p} for p in json.loads(sys.argv[3])],
                    SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
print("TOKENS", json.dumps([o.outputs[0].token_ids for o in outs]))
llm.engine.close()
"""


def ranks_agree(model: Path, tmp_path: Path, **options: object) -> list[list[int]]:
    """Runs the prompts at TP 2 under torchrun with `options`, checks that both ranks cached the same indexer keys
    and selected the same slots at every call (some of them dropping positions), and returns the greedy tokens."""
    script = tmp_path / "run.py"
    script.write_text(RECORDING_SCRIPT)
    ids = [p["prompt_token_ids"] for p in prompts()]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += [str(script), str(model), str(tmp_path), json.dumps(ids), json.dumps(options)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[:6000]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    assert len(ranks[0]) == len(ranks[1]) > 0
    for (keys0, picked0), (keys1, picked1) in zip(*ranks, strict=True):
        assert torch.equal(keys0, keys1)
        assert (picked0 is None) == (picked1 is None)
        assert picked0 is None or torch.equal(picked0, picked1)
    assert any(picked is not None and picked.shape[1] == TOPK for _, picked in ranks[0])
    lines = [line for line in done.stdout.splitlines() if line.startswith("TOKENS")]
    return json.loads(lines[0][len("TOKENS ") :])


def test_every_rank_caches_the_same_keys_and_selects_the_same_slots(tiny, tmp_path):
    model = tiny("deepseek_v32")
    got = ranks_agree(model, tmp_path, dtype="float32", device="cpu")
    want, _ = run(model)
    assert got == [o.outputs[0].token_ids for o in want]
