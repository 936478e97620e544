"""The GPU suite's `spec` section: a speculative verify step against a plain decode step, both replayed from the
engine's CUDA graphs, and the speedup that follows at the acceptance rates DeepSeek and vLLM report.

A verify step of b requests with k drafts each replays the decode graph of b x (k + 1) rows (one row per token,
mlaserve/runner/verify_graphs.py). Two models with random weights and an MTP layer (load_format dummy,
num_nextn_predict_layers 1), each an engine with speculative method mtp and k = 3 (graphs up to 32 x 4 rows):
  v2_lite_shape  DeepSeek-V2-Lite's widths (gpu_lite.V2_LITE), built as DeepSeek-V3, the architecture that carries
                 the MTP layer (so its routing is V3's sigmoid routing), bf16
  v3_width       DeepSeek-V3's widths at 4 layers (gpu_fp8.V3_LAYERS) with block-FP8 weights, as the fp8_v3 section
                 builds it (in bf16 its 256 experts per layer do not fit one GPU)
For batch 1, 8 and 32 at CONTEXT tokens per sequence, each step (k = 0: the plain decode; k = 1, 2, 3) is staged
into the graphs' inputs once and its graph replayed and timed with CUDA events, L2 emptied before each replay
(gpu_timing.bench). Beside it, the MTP draft layer's pass after a step that accepted every draft (k + 1 rows a
request, then k - 1 chained rows), run eagerly as the engine runs it after steps it cannot capture, timed by wall
clock with the device synchronized (its host work is part of its cost); and the same pass as the engine runs it
after captured steps (mlaserve/runner/mtp_graphs.py): its graph's replay alone, timed as the steps are
(mtp_draft_graph_ms), and its whole launch (staging, replay, the drafts' copy out) by wall clock
(mtp_draft_launch_ms).

Expected tokens per step at acceptance a: 1 + a + ... + a^k, each draft held with probability a once the drafts
before it held (a constant a is optimistic past the first draft: the literature reports per-position rates that
fall). speedup = expected tokens / (verify / decode); speedup_with_draft adds the eager draft pass to the verify
step, speedup_with_draft_graph the captured pass's launch.

    python -m benchmarks.gpu_suite --sections spec --out benchmarks/results/h100-spec-DATE.json
"""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from mlaserve.core.request import Request
from mlaserve.core.scheduler import ScheduledRequest, SchedulerOutput
from mlaserve.runner.batch import HostBatch, plan_batch
from mlaserve.runner.mtp_draft import DraftSpan
from mlaserve.runner.mtp_graphs import draft_key
from mlaserve.runner.spec_verify import draft_rows
from mlaserve.runner.verify_graphs import verify_as_decodes

BATCHES = (1, 8, 32)
KS = (1, 2, 3)
CONTEXT = 1024
DRAFT_ROOM = 4  # positions past the context each request's blocks hold: k + 1 rows, then k - 1 chained
ACCEPTANCE = {"vllm_r1_k1": 0.815, "deepseek_v3_low": 0.85, "deepseek_v3_high": 0.90}
SOURCES = {
    "vllm_r1_k1": "vLLM pull request #12755 (DeepSeek MTP spec decode): 81-82.3% acceptance of one MTP draft on "
    "DeepSeek-R1; 0.815 is its middle",
    "deepseek_v3_low": "DeepSeek-V3 Technical Report (arXiv 2412.19437), section 5.4.3: the second token's prediction "
    "is accepted 85-90% of the time; its low end",
    "deepseek_v3_high": "the same report, its high end",
}


def with_mtp_layer(config: dict) -> dict:
    """A DeepSeek-V3 config of these widths that declares one MTP layer."""
    return {**config, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
            "scoring_func": "sigmoid", "topk_method": "noaux_tc", "num_nextn_predict_layers": 1}  # fmt: skip


def step_batch(batch: int, drafts: int, context: int, block_size: int, vocab: int) -> HostBatch:
    """`batch` requests of `context` known tokens, each running its last one and `drafts` drafts, on blocks of their
    own (room for the draft layer's chained rows too); random token ids. The known tokens and the blocks depend on
    batch and context alone, so steps with and without drafts run over the same contexts."""
    gen = torch.Generator().manual_seed(batch)
    per = -(-(context + 2 * DRAFT_ROOM) // block_size)
    items = []
    for i in range(batch):
        known = torch.randint(0, vocab, (context,), generator=gen).tolist()
        request = Request(str(i), known, max_tokens=64, arrival_index=i)
        blocks = list(range(1 + i * per, 1 + (i + 1) * per))  # block 0 is the null block
        spec = torch.randint(0, vocab, (drafts,)).tolist()
        items.append(ScheduledRequest(request, drafts + 1, context - 1, [blocks], spec_token_ids=spec))
    return plan_batch(SchedulerOutput(items, batch * (drafts + 1), []), block_size)


def staged(graphs, rows: HostBatch) -> tuple[Callable[[], object], torch.Tensor]:
    """(a call that runs the staged step, the step's hidden states before the final norm): the captured graph's
    replay alone, its inputs staged once here; on a stand-in without captured graphs (the CPU test), the whole
    staged step each time."""
    _, prenorm = graphs.run_with_prenorm(rows)
    prenorm = prenorm.clone()
    captured = getattr(graphs, "graphs", None)
    if captured is None:
        return lambda: graphs.run_with_prenorm(rows), prenorm
    return captured[next(s for s in graphs.sizes if s >= len(rows.query_lens))].replay, prenorm


def draft_spans(host: HostBatch, context: int) -> list[DraftSpan]:
    """The draft layer's first pass after the step accepted every draft: each request's k + 1 rows."""
    spans, row = [], 0
    for s in host.order:
        n = s.num_new_tokens
        next_ids = [*s.spec_token_ids, 0]  # the tokens after each row: the drafts, then the bonus
        spans.append(DraftSpan(s.request.request_id, row, context - 1, next_ids, s.block_ids[0], True))
        row += n
    return spans


def staged_draft_pass(draft_graphs, host: HostBatch) -> tuple[Callable[[], object], Callable[[], object]]:
    """(the captured draft pass's graph replay alone, its whole launch) after the verify step `host` that accepted
    every draft, its bonus tokens zero; the verify step's static inputs must be staged (staged()). On a stand-in
    without captured graphs (the CPU test) both are the launch."""
    drafted, _ = draft_rows(host.order)
    device = draft_graphs.device
    targets = torch.tensor([t for s in drafted for t in s.spec_token_ids], dtype=torch.long, device=device)
    sampled = torch.zeros(len(host.sampled), dtype=torch.long, device=device)

    def launch() -> object:
        queued = draft_graphs.launch(host, drafted, targets, sampled, {})
        if queued.done is not None:
            queued.done.synchronize()
        return queued

    launch()
    if not draft_graphs.graphs:
        return launch, launch
    return draft_graphs.graphs[draft_key(draft_graphs.keys, len(host.ids), len(host.order))].replay, launch


def expected_tokens(a: float, k: int) -> float:
    return sum(a**j for j in range(k + 1))


def time_model(
    llm, bench: Callable, wall: Callable, batches=BATCHES, ks=KS, context: int = CONTEXT
) -> list[dict]:
    """One row per (batch, k): decode and verify milliseconds, their ratio, the draft pass and the speedups."""
    runner = llm.engine.runner
    graphs, drafter, draft_graphs = runner.graphs, runner.drafter, runner.draft_graphs
    vocab = llm.engine.model_config.hf_config.vocab_size
    block_size = llm.stats()["block_size"]
    rows = []
    for batch in batches:
        decode_ms = bench(staged(graphs, step_batch(batch, 0, context, block_size, vocab))[0])
        for k in ks:
            host = step_batch(batch, k, context, block_size, vocab)
            replay, prenorm = staged(graphs, verify_as_decodes(host))
            verify_ms = bench(replay)
            spans = draft_spans(host, context)
            draft_ms = wall(lambda spans=spans, prenorm=prenorm: drafter.propose(spans, prenorm))
            ratio = verify_ms / decode_ms
            captured = {}
            if draft_graphs is not None:
                replay, launch = staged_draft_pass(draft_graphs, host)
                graph_ms, launch_ms = bench(replay), wall(launch)
                captured = dict(mtp_draft_graph_ms=graph_ms, mtp_draft_launch_ms=launch_ms,
                                speedup_with_draft_graph={n: expected_tokens(a, k) * decode_ms / (verify_ms + launch_ms)
                                                          for n, a in ACCEPTANCE.items()})  # fmt: skip
            row = dict(batch=batch, k=k, context=context, decode_ms=decode_ms, verify_ms=verify_ms,
                       verify_over_decode=ratio, mtp_draft_ms=draft_ms,
                       expected_tokens={n: expected_tokens(a, k) for n, a in ACCEPTANCE.items()},
                       speedup={n: expected_tokens(a, k) / ratio for n, a in ACCEPTANCE.items()},
                       speedup_with_draft={n: expected_tokens(a, k) * decode_ms / (verify_ms + draft_ms)
                                           for n, a in ACCEPTANCE.items()}, **captured)  # fmt: skip
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def wall_ms(fn: Callable[[], object], repeats: int = 10) -> float:
    """Median wall milliseconds of fn, the device synchronized around each run, after one untimed run."""
    fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - start))
    return sorted(times)[len(times) // 2]


def spec(tmp: Path, bench: Callable, v2_lite: dict) -> dict:
    from benchmarks.gpu_fp8 import V3_LAYERS
    from mlaserve import LLM

    base = dict(dtype="bfloat16", device="cuda", load_format="dummy", skip_tokenizer_init=True, block_size=64,
                max_model_len=2048, gpu_memory_utilization=0.85, max_num_seqs=max(BATCHES),
                speculative_config={"method": "mtp", "num_speculative_tokens": max(KS)})  # fmt: skip
    result: dict = {"acceptance_sources": SOURCES, "acceptance": ACCEPTANCE}
    for name, config, options in (
        ("v2_lite_shape", v2_lite, {}),
        ("v3_width", V3_LAYERS, {"quantization": "fp8"}),
    ):
        folder = tmp / f"spec_{name}"
        folder.mkdir(exist_ok=True)
        (folder / "config.json").write_text(json.dumps(with_mtp_layer(config)))
        gc.collect()  # the previous engine's cache must be gone before this one sizes its own
        torch.cuda.empty_cache()
        llm = LLM(str(folder), **base, **options)
        runner = llm.engine.runner
        assert runner.graphs is not None and runner.drafter is not None and runner.draft_graphs is not None
        result[name] = {"layers": config["num_hidden_layers"], "rows": time_model(llm, bench, wall_ms)}
        del llm
    gc.collect()
    torch.cuda.empty_cache()
    result["timing"] = ("decode_ms, verify_ms: medians of CUDA-graph replays with L2 emptied before each "
                        "(gpu_timing.bench); mtp_draft_ms: median wall time of the eager draft pass; "
                        "mtp_draft_graph_ms: the captured draft pass's replay, timed as the steps are; "
                        "mtp_draft_launch_ms: median wall time of its launch (staging, replay, copy out)")  # fmt: skip
    return result
