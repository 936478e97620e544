"""On a GPU (skipped in CI): speculative decoding on engines with windows and pooled entries. Greedy tokens equal the
plain engine's and the blocks come back: prompt-lookup drafts and DeepSeek-V4's MTP layer on DeepSeek-V4 (random
float32 weights, its decode on the paged Triton kernels, decode and verify steps replayed from CUDA graphs, every
row writing the entry it completes); prompt-lookup drafts on a Llama with the training-free compress_ratio, and a
DeepSeek-V3 MTP layer under the training-free window (mla_disable), both eager (per-head K/V caches under a window
take no decode graphs).

    TRITON_INTERPRET=0 python -m pytest tests/gpu/test_speculative_windows_on_gpu.py
"""

import json

import pytest
import torch
from safetensors.torch import save_file

from mlaserve import LLM, SamplingParams
from mlaserve.runner import model_runner
from mlaserve.testing.tiny_models import build_tiny
from tests.engine.test_speculative import NGRAM
from tests.engine.test_speculative import prompts as ngram_prompts
from tests.engine.test_speculative_mtp import mtp, prompts
from tests.gpu.test_v4_on_gpu import V4

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
CUDA = dict(
    dtype="float32", device="cuda", num_kv_blocks=96, block_size=16, max_model_len=256, max_num_seqs=8
)


def run(path, batch: list[dict], captured: bool = False, **options) -> tuple[list[list[int]], dict]:
    """Greedy tokens and stats; captured: the engine must replay decode graphs, and its verify steps did too."""
    verify_steps: list[bool] = []
    real = model_runner.run_captured

    def noted(graphs, batch, source, verify_rows, keep_prenorm, shift=None):
        out = real(graphs, batch, source, verify_rows, keep_prenorm, shift)
        if verify_rows:
            verify_steps.append(out is not None)
        return out

    llm = LLM(str(path), **CUDA, **options)
    assert (llm.engine.runner.graphs is not None) == captured
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(model_runner, "run_captured", noted)
        outs = llm.generate(batch, GREEDY, use_tqdm=False)
    if captured and llm.stats()["num_draft_tokens"]:
        assert any(verify_steps)
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0
    return [o.outputs[0].token_ids for o in outs], stats


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    """V4 with an MTP layer, its random weights drawn on the CPU under the model's own names."""
    path = tmp_path_factory.mktemp("v4")
    (path / "config.json").write_text(json.dumps({**V4, "num_nextn_predict_layers": 1}))
    cpu = LLM(str(path), device="cpu", dtype="float32", skip_tokenizer_init=True, load_format="dummy", seed=3,
              num_kv_blocks=96, block_size=16, speculative_config=mtp(1))  # fmt: skip
    weights = {name: t.contiguous() for name, t in cpu.engine.executor.model.state_dict().items()}
    save_file(weights, str(path / "model.safetensors"))
    return path


def test_v4_prompt_lookup_drafts(v4) -> None:
    batch = ngram_prompts()
    want, _ = run(v4, batch, True, skip_tokenizer_init=True)
    got, stats = run(v4, batch, True, skip_tokenizer_init=True, speculative_config=NGRAM)
    assert got == want
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]


@pytest.mark.parametrize("k", [1, 2])
def test_v4_mtp_drafts(v4, k: int) -> None:
    want, _ = run(v4, prompts(), True, skip_tokenizer_init=True)
    got, stats = run(v4, prompts(), True, skip_tokenizer_init=True, speculative_config=mtp(k))
    assert got == want and stats["num_draft_tokens"] > 0


def test_llama_compress_ratio_prompt_lookup_drafts(tmp_path) -> None:
    path = build_tiny("llama", tmp_path / "llama")
    pooled = dict(sliding_window=12, num_sink_tokens=4, compress_ratio=4)
    want, _ = run(path, ngram_prompts(), **pooled)
    got, stats = run(path, ngram_prompts(), **pooled, speculative_config=NGRAM)
    assert got == want and stats["num_accepted_tokens"] > 0


@pytest.mark.parametrize("k", [1, 2])
def test_v3_mtp_under_the_window(mtp_models, k: int) -> None:
    windowed = dict(mla_disable=True, sliding_window=8, num_sink_tokens=4)
    for echo, path in mtp_models.items():
        want, _ = run(path, prompts(), **windowed)
        got, stats = run(path, prompts(), **windowed, speculative_config=mtp(k))
        assert got == want and stats["num_draft_tokens"] > 0
        if echo:
            assert stats["num_accepted_tokens"] == stats["num_draft_tokens"]
