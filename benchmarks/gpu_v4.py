"""The GPU suite's `v4` section: DeepSeek-V4-shaped decode attention from our kernels, against dense MLA decode at
the same context, with the KV bytes per token each holds.

This times the kernels a V4 decode step runs per layer, composed here as the engine composes them on the triton_mla
backend (mlaserve/attention/v4_decode.py), but for the window, read here from page 0 of its own two pages where the
engine reads it through the window group's table from the page the window starts in. Shapes are V4-Flash's
attention: 64 query heads over one shared 512-wide row that is both key and value (its last 64 features rotated), a
window of 128 tokens, entries compressed 4:1 of which an indexer (64 heads x 128) keeps 512, entries compressed
128:1, a learned sink logit per head; bf16, pages of 64, batch 32 at 65,536-token contexts.
Per layer kind:
  sliding   attention over the window's 128 rows
  hca       the window and every 128:1 entry (512), merged by log-sum-exp
  csa       index scores over the 16,384 4:1 indexer keys and top-512 (TritonMLABackend.select_topk), then the
            window and the 512 selected entries (the paged decode kernel with pages of one row), merged
  dense     absorbed MLA decode over all 65,536 latent rows of 512 + 64, 64 heads (a V3-style layer)
The sink enters every V4 layer's softmax as out * sigmoid(lse - sink). Each composition is first checked against a
torch reference (gathered rows, one softmax with the sink) at 4,096-token contexts, and the engine's (engine_*:
v4_decode, the window through a table over the whole context) against it. engine_group_* times each launch group of
the engine's composition alone (Case.engine_groups), so a run shows which one holds the gap to the composed kernels.
Device, dtype and the sizes above are parameters of Case and check, so tests run them on CPU at tiny sizes.

    python -m benchmarks.gpu_suite --sections v4 --out benchmarks/results/h200-v4-DATE.json
"""

import torch

from mlaserve.attention.metadata import build_metadata
from mlaserve.attention.triton_mla import TritonMLABackend
from mlaserve.attention.v4_decode import (
    EntryCache,
    IndexQuery,
    attend,
    attend_selected,
    select_slots,
    v4_decode,
)
from mlaserve.kernels import v4_parts
from mlaserve.kernels.mla_decode.decode import mla_decode

HEADS, DIM, ROPE, WINDOW, PAGE = 64, 512, 64, 128, 64
CSA_RATE, HCA_RATE, TOPK, INDEX_HEADS, INDEX_DIM = 4, 128, 512, 64, 128


def paged_rows(
    batch: int, rows: int, width: int, gen: torch.Generator, dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows` rows of `width` per sequence on shuffled pages: (cache [pages + 1, PAGE, 1, width], table)."""
    per = -(-rows // PAGE)
    cache = torch.randn(batch * per + 1, PAGE, 1, width, generator=gen, device=gen.device).to(dtype)
    table = (
        (torch.randperm(batch * per, generator=gen, device=gen.device) + 1).to(torch.int32).view(batch, per)
    )
    return cache, table


def merge(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]):
    lse = torch.logaddexp(a[1], b[1])
    out = a[0].float() * torch.exp(a[1] - lse)[..., None] + b[0].float() * torch.exp(b[1] - lse)[..., None]
    return out, lse


def with_sink(part: tuple[torch.Tensor, torch.Tensor], sink: torch.Tensor) -> torch.Tensor:
    return (part[0].float() * torch.sigmoid(part[1] - sink)[..., None]).to(part[0].dtype)


class Case:
    """One batch's caches and queries at `context` tokens: window rows, both compressed caches, indexer keys."""

    def __init__(
        self, batch: int, context: int, seed: int, device: str = "cuda", dtype: torch.dtype = torch.bfloat16
    ) -> None:
        gen = torch.Generator(device=device).manual_seed(seed)
        self.batch, self.context, self.csa, self.hca = (
            batch,
            context,
            context // CSA_RATE,
            context // HCA_RATE,
        )
        self.window, self.window_table = paged_rows(batch, WINDOW, DIM, gen, dtype)
        self.csa_rows, self.csa_table = paged_rows(batch, self.csa, DIM, gen, dtype)
        self.hca_rows, self.hca_table = paged_rows(batch, self.hca, DIM, gen, dtype)
        self.index_keys, _ = paged_rows(batch, self.csa, INDEX_DIM, gen, dtype)
        self.index_meta = build_metadata(
            PAGE, self.csa_table, [1] * batch, [self.csa] * batch, batch, torch.zeros(0, dtype=torch.long)
        )
        self.lens = {n: torch.full((batch,), n, dtype=torch.int32, device=device) for n in (WINDOW, self.hca)}
        self.q = torch.randn(batch, HEADS, DIM, generator=gen, device=device).to(dtype)
        self.index_q = torch.randn(batch, INDEX_HEADS, INDEX_DIM, generator=gen, device=device).to(dtype)
        self.weights = torch.randn(batch, INDEX_HEADS, generator=gen, device=device)
        self.positions = torch.full((batch,), self.csa - 1, device=device)
        self.sink = torch.randn(HEADS, generator=gen, device=device)
        self.scale = DIM**-0.5

    def window_part(self):
        return mla_decode(self.q, self.window, self.window_table, self.lens[WINDOW], WINDOW, DIM, self.scale)

    def sliding(self) -> torch.Tensor:
        return with_sink(self.window_part(), self.sink)

    def hca_layer(self) -> torch.Tensor:
        hca = mla_decode(
            self.q, self.hca_rows, self.hca_table, self.lens[self.hca], self.hca, DIM, self.scale
        )
        return with_sink(merge(self.window_part(), hca), self.sink)

    def select(self, backend: TritonMLABackend) -> torch.Tensor:
        return backend.select_topk(
            self.index_q,
            self.weights,
            self.index_keys,
            self.index_meta,
            self.positions,
            TOPK,
            INDEX_DIM**-0.5,
        )

    def csa_layer(self, backend: TritonMLABackend, slots: torch.Tensor | None = None) -> torch.Tensor:
        slots = self.select(backend) if slots is None else slots
        rows = self.csa_rows.view(-1, 1, 1, DIM)
        lens = (slots >= 0).sum(dim=1, dtype=torch.int32)
        picked = mla_decode(self.q, rows, slots.clamp(min=0).to(torch.int32), lens, TOPK, DIM, self.scale)
        return with_sink(merge(self.window_part(), picked), self.sink)

    def engine_inputs(self) -> tuple[torch.Tensor, torch.Tensor, EntryCache, EntryCache]:
        """What the engine's composition reads: the window group's tables over the whole context (the window's
        pages last), the lengths, the compressed-sparse entries with their indexer keys after them in one tensor,
        the heavily compressed entries."""
        tables = torch.zeros(self.batch, self.context // PAGE, dtype=torch.int32, device=self.q.device)
        tables[:, -self.window_table.shape[1] :] = self.window_table
        lens = torch.full((self.batch,), self.context, dtype=torch.int32, device=self.q.device)
        index = IndexQuery(self.index_q, self.weights, INDEX_DIM**-0.5, TOPK)
        csa = EntryCache(
            torch.cat((self.csa_rows, self.index_keys), -1), self.csa_table, CSA_RATE, self.csa, index
        )
        hca = EntryCache(self.hca_rows, self.hca_table, HCA_RATE, self.hca)
        return tables, lens, csa, hca

    def engine_layers(self) -> dict:
        """The three layers as the engine runs them (v4_decode)."""
        tables, lens, csa, hca = self.engine_inputs()

        def layer(entries: EntryCache | None):
            return lambda: v4_decode(
                self.q, self.sink, self.scale, self.window, tables, lens, WINDOW, entries
            )

        return {"sliding": layer(None), "hca": layer(hca), "csa": layer(csa)}

    def engine_groups(self) -> dict:
        """Each launch group of the engine's composition alone, on the inputs its layers give it, to show where
        the engine's time goes: the window's decode (at this case's lengths, whose windows start on a tile, and
        where they do not), the entries' counts, the 128:1 entries' decode, the indexer's
        selection (scores, top-k, slots), the selected entries' decode, the merge with the sink of one part and of
        two."""
        tables, lens, csa, hca = self.engine_inputs()
        window = attend(self.q, self.window, tables, lens, WINDOW, self.scale, WINDOW)
        counts = {rate: v4_parts.entry_rows(lens, rate) for rate in (CSA_RATE, HCA_RATE)}
        slots = select_slots(self.q, csa, counts[CSA_RATE].counts, counts[CSA_RATE].rows)
        hca_part = attend(self.q, hca.cache, hca.tables, counts[HCA_RATE].counts, hca.max_count, self.scale)
        # a window that starts inside a tile, as most decode steps' do: one more tile read, its first rows masked
        unaligned = lens - 37
        return {
            "window": lambda: attend(self.q, self.window, tables, lens, WINDOW, self.scale, WINDOW),
            "window_unaligned": lambda: attend(
                self.q, self.window, tables, unaligned, WINDOW, self.scale, WINDOW
            ),
            "entry_rows": lambda: v4_parts.entry_rows(lens, HCA_RATE),
            "hca_entries": lambda: attend(
                self.q, hca.cache, hca.tables, counts[HCA_RATE].counts, hca.max_count, self.scale
            ),
            "csa_select": lambda: select_slots(self.q, csa, counts[CSA_RATE].counts, counts[CSA_RATE].rows),
            "csa_entries": lambda: attend_selected(self.q, csa, slots, self.scale),
            "merge_1": lambda: v4_parts.merge_with_sink([window], self.sink, self.q.dtype),
            "merge_2": lambda: v4_parts.merge_with_sink([window, hca_part], self.sink, self.q.dtype),
        }


def gathered(cache: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
    pos = torch.arange(n, device=cache.device)
    slots = table.long()[:, pos // PAGE] * PAGE + pos % PAGE
    return cache.view(-1, cache.shape[-1])[slots].float()  # [B, n, width]


def reference(case: Case, parts: list[torch.Tensor]) -> torch.Tensor:
    """One softmax with the sink over the concatenated rows [B, n, DIM] (keys and values alike)."""
    rows = torch.cat(parts, dim=1)
    scores = torch.einsum("bhd,bnd->bhn", case.q.float(), rows) * case.scale
    scores = torch.cat((scores, case.sink[None, :, None].expand(case.batch, -1, 1)), dim=-1)
    return torch.einsum("bhn,bnd->bhd", scores.softmax(-1)[..., :-1], rows)


def check(
    backend: TritonMLABackend, context: int = 4096, device: str = "cuda", dtype: torch.dtype = torch.bfloat16
) -> dict:
    case = Case(4, context, 1, device, dtype)
    window = gathered(case.window, case.window_table, WINDOW)
    slots = case.select(backend)
    picked = case.csa_rows.view(-1, DIM)[slots].float()  # every slot valid: 1,024 entries, top-512
    errors = {
        "sliding": (case.sliding().float() - reference(case, [window])).abs().max().item(),
        "hca": (case.hca_layer().float() - reference(case, [window, gathered(case.hca_rows, case.hca_table, case.hca)]))
        .abs().max().item(),
        "csa": (case.csa_layer(backend, slots).float() - reference(case, [window, picked])).abs().max().item(),
    }  # fmt: skip
    composed = {"sliding": case.sliding, "hca": case.hca_layer, "csa": lambda: case.csa_layer(backend, slots)}
    for kind, layer in case.engine_layers().items():
        errors[f"engine_{kind}"] = (layer().float() - composed[kind]().float()).abs().max().item()
    # every launch group the section times runs, and the window's then the merge's make the sliding layer
    outputs = {name: group() for name, group in case.engine_groups().items()}
    merged = outputs["merge_1"].float()
    errors["engine_groups_sliding"] = (merged - case.engine_layers()["sliding"]().float()).abs().max().item()
    assert all(e < 2e-2 for e in errors.values()), errors
    return {f"{k}_max_abs_err": v for k, v in errors.items()}


def kv_bytes_per_token(context: int) -> dict:
    """bf16 bytes each layer kind holds per token of context (the window's rows spread over the context)."""
    window = WINDOW * DIM * 2 / context
    return {
        "sliding": window,
        "hca": window + DIM * 2 / HCA_RATE,
        "csa": window + (DIM + INDEX_DIM) * 2 / CSA_RATE,
        "dense_mla": (DIM + ROPE) * 2,
    }


def v4(bench, bench_graph) -> dict:
    backend = TritonMLABackend()
    result = {"check": check(backend)}
    batch, context = 32, 65536
    case = Case(batch, context, seed=2)
    gen = torch.Generator(device="cuda").manual_seed(3)
    latent, table = paged_rows(batch, context, DIM + ROPE, gen)
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, HEADS, DIM + ROPE, generator=gen, device="cuda").to(torch.bfloat16)
    ms = {
        "dense_mla": bench_graph(lambda: mla_decode(q[..., :DIM], latent, table, lens, context, DIM, 0.05,
                                                    q_pe=q[..., DIM:])),
        "sliding": bench_graph(case.sliding),
        "hca": bench_graph(case.hca_layer),
        "csa_select": bench_graph(lambda: case.select(backend)),
        "csa": bench_graph(lambda: case.csa_layer(backend)),
        **{f"engine_{kind}": bench_graph(layer) for kind, layer in case.engine_layers().items()},
        **{f"engine_group_{name}": bench_graph(group) for name, group in case.engine_groups().items()},
    }  # fmt: skip
    result.update(
        shape=dict(batch=batch, context=context, heads=HEADS, dim=DIM, window=WINDOW, csa_rate=CSA_RATE,
                   hca_rate=HCA_RATE, index_topk=TOPK, index_heads=INDEX_HEADS, index_dim=INDEX_DIM, page=PAGE),
        ms=ms, speedup_vs_dense={k: ms["dense_mla"] / v for k, v in ms.items()
                                 if k != "dense_mla" and not k.startswith("engine_group_")},
        kv_bytes_per_token=kv_bytes_per_token(context),
        timing="medians of CUDA-graph replays with L2 emptied before each (gpu_timing.bench)",
        note="kernels composed per V4 layer kind; engine_*: the engine's composition (attention/v4_decode.py); "
             "engine_group_*: each of its launch groups alone (sliding = window + merge_1, hca = window + "
             "entry_rows + hca_entries + merge_2, csa = window + entry_rows + csa_select + csa_entries + merge_2)",
    )  # fmt: skip
    return result
