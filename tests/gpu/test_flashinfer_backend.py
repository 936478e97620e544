"""On a Hopper GPU with FlashInfer importable (skipped otherwise): the flashinfer_mla backend's decode against the
torch reference at 16, 64 and 128 heads, pages of 1, 16 and 64 and uneven batches, eagerly and replayed from a CUDA
graph after replanning with other lengths; and a tiny bf16 DeepSeek-V3 at DeepSeek's latent widths (512 + 64)
decoding the same greedy tokens on it as on triton_mla. ../shared/peers/flashinfer/README.md says how FlashInfer
reaches the GPU machine."""

import importlib.util

import pytest
import torch

from mlaserve import LLM, SamplingParams
from mlaserve.attention.flashinfer_mla import FlashInferMLABackend
from mlaserve.attention.flashinfer_rule import DECODE_ENV, FLASHINFER_MIN_BATCH
from mlaserve.attention.metadata import build_metadata
from mlaserve.attention.torch_ref import TorchBackend
from mlaserve.testing.paged_case import LAT, paged_case
from mlaserve.testing.tiny_models import build_tiny

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = [
    pytest.mark.skipif(not HOPPER, reason="FlashInfer's fa3 MLA decode needs an sm_90 GPU"),
    pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="flashinfer is not importable"),
]

SCALE = 0.07
# Where the greedy runs first part, the two tokens must be this close under triton_mla's own logprobs: a near-tie
# that a bf16 rounding difference in attention breaks either way (test_greedy_on_gpu.py's TIE_NATS).
TIE_NATS = 0.1


def uneven(batch: int, longest: int, seed: int) -> list[int]:
    """Lengths from 1 to `longest`, the longest always present (it sets the tables' width)."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, longest + 1, (batch,), generator=gen).tolist()
    lens[seed % batch] = longest
    return lens


def reference(q: torch.Tensor, cache: torch.Tensor, meta) -> torch.Tensor:
    return TorchBackend().decode(q.float(), cache.float(), None, meta, SCALE, LAT)[0]


def decode(backend: FlashInferMLABackend, q: torch.Tensor, cache: torch.Tensor, meta) -> torch.Tensor:
    return backend.decode_latent(q[..., :LAT], q[..., LAT:], cache, meta, SCALE, LAT)


@pytest.mark.parametrize("heads", [16, 64, 128])
@pytest.mark.parametrize("page", [1, 16, 64])
def test_eager_decode_matches_reference(monkeypatch, heads, page):
    monkeypatch.setenv(DECODE_ENV, "always")
    backend = FlashInferMLABackend()
    for batch, longest in ((1, 700), (5, 300), (37, 1100)):
        q, cache, _, meta = paged_case(
            batch, heads, uneven(batch, longest, batch), page, torch.bfloat16, batch
        )
        got = decode(backend, q, cache, meta)
        assert meta.decode_plan.planned, "the step should have gone to FlashInfer"
        torch.testing.assert_close(got.float(), reference(q, cache, meta), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("page", [1, 64])
def test_graph_replay_reads_the_replanned_page_lists(monkeypatch, heads, page):
    """As the runner drives it: planned at capture with every row at its longest, then replanned with a step's
    shorter, uneven lengths and the rows' tables in another order before the replay."""
    monkeypatch.setenv(DECODE_ENV, "always")
    backend = FlashInferMLABackend()
    rows, longest = 24, 520
    q, cache, table, _ = paged_case(rows, heads, [longest] * rows, page, torch.bfloat16, 3)
    max_pages = table.shape[1]
    plan = backend.graph_decode_plan(rows, max_pages)
    captured = build_metadata(page, table, [1] * rows, [longest] * rows, rows, torch.zeros(0).long().cuda())
    captured.decode_plan = plan
    decode(backend, q, cache, captured)  # plans, outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode(backend, q, cache, captured)
    for seed in (1, 2):
        lens = uneven(rows, longest, seed)
        order = torch.randperm(rows, generator=torch.Generator().manual_seed(seed))
        table.copy_(table[order.cuda()])
        q.copy_(torch.randn_like(q))
        plan.replan(torch.tensor(lens, dtype=torch.int32), table.cpu())
        graph.replay()
        step = build_metadata(page, table, [1] * rows, lens, rows, torch.zeros(0).long().cuda())
        torch.testing.assert_close(out.float(), reference(q, cache, step), atol=2e-2, rtol=2e-2)


def test_rule_keeps_small_batches_on_our_kernels():
    backend = FlashInferMLABackend()
    for batch in (1, FLASHINFER_MIN_BATCH):
        q, cache, _, meta = paged_case(batch, 16, uneven(batch, 200, 0), 64, torch.bfloat16, 0)
        got = decode(backend, q, cache, meta)
        assert meta.decode_plan.planned == (batch >= FLASHINFER_MIN_BATCH)
        torch.testing.assert_close(got.float(), reference(q, cache, meta), atol=2e-2, rtol=2e-2)


def generate(path, backend: str, eager: bool, prompts: list) -> tuple[list, dict]:
    llm = LLM(str(path), dtype="bfloat16", device="cuda", attention_backend=backend, enforce_eager=eager,
              num_kv_blocks=128, block_size=16, max_model_len=256)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=20)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.stats()
    del llm
    return outputs, stats


def test_tiny_deepseek_v3_greedy_tokens_match_triton(monkeypatch, tmp_path):
    """Every step on FlashInfer (the switch forces it, so small batches take it too), eagerly and from graphs."""
    path = build_tiny("deepseek_v3", tmp_path, num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512,
                      qk_rope_head_dim=64)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    lengths = (1, 7, 40, 120, 3, 64)
    prompts = [{"prompt_token_ids": torch.randint(3, 250, (n,), generator=gen).tolist()} for n in lengths]
    want, ours = generate(path, "triton_mla", False, prompts)
    assert ours["attention_backend"] == "triton_mla"
    monkeypatch.setenv(DECODE_ENV, "always")
    for eager in (True, False):
        got, stats = generate(path, "flashinfer_mla", eager, prompts)
        assert stats["attention_backend"] == "flashinfer_mla"
        assert stats["attention_kernel"] == f"flashinfer fa3 ({DECODE_ENV}=always)"
        for ref, run in zip(want, got, strict=True):
            a, b = ref.outputs[0].token_ids, run.outputs[0].token_ids
            first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
            if first is None:
                continue
            step = ref.outputs[0].logprobs[first]
            assert b[first] in step, f"eager={eager}: token {b[first]} not in triton's top 20 at {first}"
            gap = step[a[first]].logprob - step[b[first]].logprob
            assert gap < TIE_NATS, f"eager={eager}: not a near-tie at token {first} (gap {gap:.3f} nats)"
