"""FlashInfer in the attention table, without FlashInfer or a GPU: the rule, the names the start-up log and stats()
show, the selector's fall-back, the backend's decode falling back to our kernels where the rule declines, and, through
a plain-torch stand-in for FlashInfer's wrapper, the page lists an eager step and a replanned graph hand it."""

import sys
import types

import pytest
import torch

from mlaserve.attention import flashinfer_mla, selector
from mlaserve.attention.flashinfer_mla import FlashInferMLABackend
from mlaserve.attention.flashinfer_rule import (
    DECODE_ENV,
    FLASHINFER_MIN_BATCH,
    decode_policy,
    describe_choice,
    flashinfer_pays,
    flashinfer_refusal,
)
from mlaserve.attention.metadata import build_metadata
from mlaserve.attention.torch_ref import TorchBackend
from mlaserve.kernels.mla_decode.rules import DecodeShape

BF16 = torch.bfloat16


def shape(dtype: torch.dtype = BF16, rank: int = 512, rope: int = 64, query: torch.dtype | None = None):
    return DecodeShape(128, rank, rope, dtype, query or dtype, 64)


def test_rule_takes_deepseek_bf16_and_refuses_what_fa3_cannot_read():
    assert flashinfer_refusal(shape()) is None
    assert flashinfer_refusal(shape(torch.float16)) is None
    assert "not float8_e4m3fn" in flashinfer_refusal(shape(torch.float8_e4m3fn, query=BF16))
    assert "not float32" in flashinfer_refusal(shape(torch.float32))
    assert "latent ranks" in flashinfer_refusal(shape(rank=32))
    assert "rotary widths" in flashinfer_refusal(shape(rope=16))
    assert "query of the cache's dtype" in flashinfer_refusal(shape(query=torch.float16))


def test_rule_sends_large_batches_only_and_the_switch_forces_either():
    assert not flashinfer_pays(1) and not flashinfer_pays(FLASHINFER_MIN_BATCH - 1)
    assert flashinfer_pays(FLASHINFER_MIN_BATCH) and flashinfer_pays(512)
    assert flashinfer_pays(1, "always") and not flashinfer_pays(512, "never")


def test_policy_comes_from_the_environment_and_is_checked(monkeypatch):
    assert decode_policy() == "rule"
    monkeypatch.setenv(DECODE_ENV, "always")
    assert decode_policy() == "always"
    monkeypatch.setenv(DECODE_ENV, "sometimes")
    with pytest.raises(ValueError, match=f"{DECODE_ENV}='sometimes'; choose one of rule, always, never"):
        FlashInferMLABackend()


def test_names_say_which_kernel_runs_where():
    assert (
        describe_choice(shape(), "triton")
        == f"flashinfer fa3 where batch >= {FLASHINFER_MIN_BATCH}, else triton"
    )
    fp8 = describe_choice(shape(torch.float8_e4m3fn, query=BF16), "gluon_fp8")
    assert fp8.startswith("gluon_fp8 (flashinfer fa3 takes bfloat16 and float16 caches")
    assert describe_choice(shape(), "triton", "never") == f"triton ({DECODE_ENV}=never)"
    backend = FlashInferMLABackend()
    name = backend.decode_kernel(128, 512, 64, BF16, 64, torch.device("cpu"))
    assert name.startswith(f"flashinfer fa3 where batch >= {FLASHINFER_MIN_BATCH}, else ")
    # sparse attention (DeepSeek-V3.2) stays on our kernels, and says so
    assert "flashinfer" not in backend.sparse_kernels(128, 512, 64, BF16, torch.device("cpu"))


def test_without_flashinfer_the_selector_keeps_our_kernels_and_says_why(monkeypatch):
    monkeypatch.setattr(flashinfer_mla, "flashinfer_missing", lambda: "flashinfer is not importable (test)")
    monkeypatch.setattr(
        selector.TritonMLABackend, "unavailable_reason", classmethod(lambda cls, device: None)
    )
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda")
    name, why = selector.choose_backend(cuda)
    assert name == "triton_mla" and "no FlashInfer decode: flashinfer is not importable (test)" in why
    with pytest.raises(ValueError, match="'flashinfer_mla' cannot run on cuda: flashinfer is not importable"):
        selector.choose_backend(cuda, "flashinfer_mla")
    monkeypatch.setattr(flashinfer_mla, "flashinfer_missing", lambda: None)
    name, why = selector.choose_backend(cuda)  # importable, but not the default until its GPU checks ran
    assert name == "triton_mla" and "taken only with attention_backend='flashinfer_mla'" in why
    monkeypatch.setattr(selector, "FLASHINFER_BY_DEFAULT", True)
    name, why = selector.choose_backend(cuda)
    assert (
        name == "flashinfer_mla" and f"FlashInfer fa3 MLA decode where batch >= {FLASHINFER_MIN_BATCH}" in why
    )
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert selector.choose_backend(cuda)[0] == "triton_mla"


def test_cpu_default_is_unchanged():
    assert selector.choose_backend(torch.device("cpu"))[0] == "sdpa"
    assert "flashinfer" in FlashInferMLABackend.unavailable_reason(torch.device("cpu")).lower()


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_declined_steps_decode_on_our_table_and_never_touch_flashinfer(monkeypatch, cache_dtype):
    """A batch under the rule's threshold (float16, which the interpreter runs) and a float32 cache at any batch
    both run the table's kernel and mark the step's plan declined, so later layers skip the rule."""
    batch = 3 if cache_dtype == torch.float16 else 2 * FLASHINFER_MIN_BATCH
    page, lat, rope, heads = 4, 512, 64, 2
    lens = [5 + 3 * i for i in range(batch)]
    blocks = [-(-n // page) for n in lens]
    table = torch.zeros(batch, max(blocks), dtype=torch.int32)
    start = 1
    for i, k in enumerate(blocks):
        table[i, :k] = torch.arange(start, start + k)
        start += k
    cache = torch.randn(start, page, 1, lat + rope).to(cache_dtype)
    meta = build_metadata(page, table, [1] * batch, lens, batch, torch.zeros(0, dtype=torch.long))
    q = torch.randn(batch, heads, lat + rope).to(cache_dtype)
    backend = FlashInferMLABackend()
    monkeypatch.setattr(backend, "_workspace_on", lambda device: pytest.fail("planned a declined step"))
    got = backend.decode_latent(q[..., :lat], q[..., lat:], cache, meta, 0.1, lat)
    assert meta.decode_plan is not None and meta.decode_plan.declined
    want = TorchBackend().decode(q.float(), cache.float(), None, meta, 0.1, lat)[0]
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


class StandInWrapper:
    """FlashInfer's MLA wrapper as far as the backend uses it, in plain torch: plan keeps the CSR page lists (copied
    into the reserved buffers for a graph wrapper, as FlashInfer does), run attends over exactly those pages."""

    def __init__(self, workspace, use_cuda_graph=False, qo_indptr=None, kv_indptr=None, kv_indices=None,
                 kv_len_arr=None, backend="auto"):  # fmt: skip
        assert backend == "fa3"
        self.reserved = (qo_indptr, kv_indptr, kv_indices, kv_len_arr) if use_cuda_graph else None

    def plan(self, *, metadata, num_heads, head_dim_ckv, head_dim_kpe, page_size, sm_scale, **options):
        qo, kv_indptr, kv_indices, lens = metadata
        assert all(t.dtype == torch.int32 and t.dim() == 1 for t in metadata)
        assert torch.equal(kv_indptr[1:] - kv_indptr[:-1], (lens + page_size - 1) // page_size)
        assert torch.equal(qo, torch.arange(len(lens) + 1, dtype=torch.int32))
        if (
            self.reserved is not None
        ):  # the captured run reads these buffers, so a replan must write into them
            for buffer, value in zip(self.reserved, metadata, strict=True):
                buffer[: len(value)].copy_(value)
            metadata = tuple(b[: len(v)] for b, v in zip(self.reserved, metadata, strict=True))
        self.lists, self.page, self.scale = metadata, page_size, sm_scale

    def run(self, query, kv_cache):
        q = torch.cat(query, dim=-1).float()
        _, kv_indptr, kv_indices, lens = self.lists
        rank = query[0].shape[-1]
        out = []
        for i in range(q.shape[0]):
            pages = kv_indices[kv_indptr[i] : kv_indptr[i + 1]].long()
            rows = kv_cache[pages].reshape(-1, kv_cache.shape[-1])[: lens[i]].float()
            weights = torch.softmax(q[i] @ rows.T * self.scale, dim=-1)
            out.append(weights @ rows[:, :rank])
        return torch.stack(out).to(query[0].dtype)


def stand_in_flashinfer(monkeypatch) -> None:
    mla = types.SimpleNamespace(BatchMLAPagedAttentionWrapper=StandInWrapper, MLAPlanMetadata=types.SimpleNamespace(
        csr=lambda *lists: lists))  # fmt: skip
    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(mla=mla))


def uneven_case(batch: int, page: int, seed: int, heads: int = 2):
    """Lengths 1..40 in pages of `page`, tables of shuffled blocks (block 0 unused), float32 at 512 + 64."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 41, (batch,), generator=gen).tolist()
    blocks = [-(-n // page) for n in lens]
    order = torch.randperm(sum(blocks), generator=gen) + 1
    table = torch.zeros(
        batch, max(blocks) + 2, dtype=torch.int32
    )  # wider than needed: stale columns are skipped
    table[:, -1] = 7
    start = 0
    for i, k in enumerate(blocks):
        table[i, :k] = order[start : start + k]
        start += k
    cache = torch.randn(sum(blocks) + 1, page, 1, 576, generator=gen)
    q = torch.randn(batch, heads, 576, generator=gen)
    meta = build_metadata(page, table, [1] * batch, lens, batch, torch.zeros(0, dtype=torch.long))
    return q, cache, table, meta


@pytest.mark.parametrize("page", [1, 4])
def test_eager_plan_lists_each_rows_pages(monkeypatch, page):
    stand_in_flashinfer(monkeypatch)
    monkeypatch.setenv(DECODE_ENV, "always")
    backend = FlashInferMLABackend()
    q, cache, _, meta = uneven_case(5, page, page)
    q, cache = q.bfloat16(), cache.bfloat16()
    got = backend.decode_latent(q[..., :512], q[..., 512:], cache, meta, 0.1, 512)
    assert meta.decode_plan.planned and meta.decode_plan in backend._recent
    want = TorchBackend().decode(q.float(), cache.float(), None, meta, 0.1, 512)[0]
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_graph_plan_is_replanned_in_its_buffers_from_host_tables(monkeypatch):
    stand_in_flashinfer(monkeypatch)
    monkeypatch.setenv(DECODE_ENV, "always")
    backend = FlashInferMLABackend()
    q, cache, table, meta = uneven_case(6, 4, 0)
    q, cache = q.bfloat16(), cache.bfloat16()
    plan = backend.graph_decode_plan(6, table.shape[1])
    capture = build_metadata(4, table, [1] * 6, [40] * 6, 6, torch.zeros(0, dtype=torch.long))
    capture.decode_plan = plan
    backend.decode_latent(q[..., :512], q[..., 512:], cache, capture, 0.1, 512)  # the capture's plan
    plan.replan(meta.seq_lens, table)  # the step's own lengths, as DecodeGraphs.run hands them over
    assert plan.buffers[3].tolist() == meta.host_seq_lens and plan not in backend._recent
    got = backend.decode_latent(q[..., :512], q[..., 512:], cache, capture, 0.1, 512)
    want = TorchBackend().decode(q.float(), cache.float(), None, meta, 0.1, 512)[0]
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
