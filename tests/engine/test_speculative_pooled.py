"""Prompt-lookup drafts on engines whose cache groups pool entries: DeepSeek-V4 (its compressed entries of rates 4
and 8 and its window of rows) and a Llama with the training-free compress_ratio. Greedy tokens equal the plain
engine's, batched, chunked and from prefix hits, and every block goes back.

A rejected draft's row, and an entry its position completed, must leave no trace: the next step computes that
position again and so rewrites both. To make any read of such a trace show, every step's rejected rows and the
entries they completed are overwritten with huge values before the next step runs (Poison), and the run must still
give the plain engine's tokens; the run must also have completed entries at rejected drafts of every pooled group,
so the case is really exercised."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from mlaserve import LLM, SamplingParams
from mlaserve.core.scheduler import Scheduler
from mlaserve.testing.tiny_models import build_tiny

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
POISON = 1e3  # finite: masked reads of unused slots multiply it by zero, as they would any stale row


def prompts(seed: int = 0) -> list[dict]:
    """Prompts that repeat a phrase (drafts found and often accepted) and random ones (drafts mostly rejected),
    most longer than the V4 groups' common block of 32 tokens, so a second run hits the prefix cache."""
    gen = torch.Generator().manual_seed(seed)
    repeating = [torch.randint(3, 250, (n,), generator=gen).tolist() * 4 for n in (3, 9, 11)]
    random = [torch.randint(3, 250, (n,), generator=gen).tolist() for n in (17, 40)]
    return [{"prompt_token_ids": p} for p in repeating + random]


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


class Poison:
    """Wraps Scheduler.update_from_output: before a step's drafts are settled, the rows of its rejected drafts and
    the pooled entries those positions completed are overwritten in every layer's cache, and counted per group."""

    def __init__(self, llm: LLM) -> None:
        cache = llm.engine.core.executor.kv_cache
        self.cache = cache
        self.rules = cache.group_rules
        self.completed = [0] * len(self.rules)  # entries completed at rejected drafts, per pooled group

    def __call__(self, update: Callable) -> Callable:
        def wrapped(
            scheduler: Scheduler, output: object, sampled: dict[str, int], num_accepted: dict | None = None
        ) -> list:
            for item in output.scheduled:
                drafts = item.spec_token_ids
                rid = item.request.request_id
                if not drafts or rid not in sampled:
                    continue
                end = item.num_computed_tokens + item.num_new_tokens
                first = end - len(drafts) + (num_accepted or {}).get(rid, 0)
                for position in range(first, end):
                    self._poison(item.block_ids, position)
            return update(scheduler, output, sampled, num_accepted)

        return wrapped

    def _poison(self, block_ids: list[list[int]], position: int) -> None:
        size = self.cache.block_size
        for g, rule in enumerate(self.rules):
            if rule.ratio is None:
                index = position
            elif (position + 1) % rule.ratio == 0:
                index = position // rule.ratio
                self.completed[g] += 1
            else:
                continue
            block, offset = block_ids[g][index // size], index % size
            for tensor in self._tensors(g):
                tensor[..., block, offset, :, :] = POISON

    def _tensors(self, group: int) -> list[torch.Tensor]:
        """The tensors whose blocks are group's: with one shared pool every layer's (a block id is one group's at a
        time); with a pool per group the rows of the group's layers, or the entries of the layers pooled into it."""
        spec, out = self.cache.spec, []
        for layer, tensors, own in zip(spec.layers, self.cache.tensors, spec.layer_groups(), strict=True):
            parts = list(tensors) if isinstance(tensors, tuple) else [tensors]
            if not spec.pool_per_group:
                out += parts
            elif own == group:
                out.append(parts[0])
            elif spec.entry_group(layer) == group:
                out.append(parts[1])
        return out


def speculate(
    path: Path, options: dict, batch: list[dict], runs: int = 1
) -> tuple[list[list[list[int]]], LLM, Poison]:
    """The tokens of each of `runs` runs of the batch on one speculating engine whose rejected traces are
    poisoned."""
    llm = LLM(str(path), **options, speculative_config=NGRAM)
    poison = Poison(llm)
    original = Scheduler.update_from_output
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Scheduler, "update_from_output", poison(original))
        outs = [tokens(llm.generate(batch, GREEDY, use_tqdm=False)) for _ in range(runs)]
    return outs, llm, poison


def check_stats(llm: LLM, poison: Poison) -> None:
    stats = llm.stats()
    assert stats["speculative_decoding"] and stats["kv_blocks_used"] == 0
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]  # drafts both accepted and rejected
    pooled = [g for g, rule in enumerate(poison.rules) if rule.ratio is not None]
    assert pooled and all(poison.completed[g] > 0 for g in pooled), poison.completed


MODELS = {
    "deepseek_v4": dict(dtype="float32", device="cpu", block_size=4, num_kv_blocks=256),
    "llama": dict(
        dtype="float32", device="cpu", block_size=4, num_kv_blocks=256, sliding_window=12, num_sink_tokens=4,
        compress_ratio=4,
    ),
}  # fmt: skip


@pytest.fixture(scope="module", params=list(MODELS))
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    path = build_tiny(request.param, tmp_path_factory.mktemp(request.param))
    options = MODELS[request.param]
    plain = LLM(str(path), **options)
    return path, options, tokens(plain.generate(prompts(), GREEDY, use_tqdm=False))


def test_batched_greedy_tokens_equal_the_plain_engines(model: tuple) -> None:
    path, options, want = model
    (got,), llm, poison = speculate(path, options, prompts())
    assert got == want
    check_stats(llm, poison)


def test_chunked_and_prefix_hits(model: tuple) -> None:
    """A 13-token step splits prompts inside entries and caps the drafts; the second run starts from the prefix
    cache's blocks (every group's, entries included)."""
    path, options, want = model
    chunked = {**options, "enable_chunked_prefill": True, "max_num_batched_tokens": 13}
    (first, second), llm, poison = speculate(path, chunked, prompts(), runs=2)
    assert first == second == want
    assert llm.stats()["prefix_cache_hits"] > 0
    check_stats(llm, poison)


def test_poisoned_traces_would_show(model: tuple) -> None:
    """The poison is strong enough to change tokens where it is read: written at a step's accepted rows instead
    (which the next steps do read), the tokens differ from the plain engine's."""
    path, options, want = model
    llm = LLM(str(path), **options, speculative_config=NGRAM)
    poison = Poison(llm)
    original = Scheduler.update_from_output

    def accepted_rows(
        scheduler: Scheduler, output: object, sampled: dict[str, int], num_accepted: dict | None = None
    ) -> list:
        for item in output.scheduled:
            rid = item.request.request_id
            if item.spec_token_ids and (num_accepted or {}).get(rid, 0):
                start = item.num_computed_tokens + item.num_new_tokens - len(item.spec_token_ids)
                poison._poison(item.block_ids, start)  # the first accepted draft's row
        return original(scheduler, output, sampled, num_accepted)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Scheduler, "update_from_output", accepted_rows)
        got = tokens(llm.generate(prompts(), GREEDY, use_tqdm=False))
    assert got != want


@pytest.mark.parametrize("model", ["deepseek_v4"], indirect=True)  # the Llama's windowed K/V take no graphs
def test_v4_verify_steps_through_the_captured_steps_inputs(model, monkeypatch) -> None:
    """DeepSeek-V4's decode steps are captured: its verify steps replay them one row per token, each row writing the
    entry its position completes (staged as the graphs stage them, on CPU: tests/models/test_deepseek_v4.py's
    stand-in). Tokens equal the plain engine's with the rejected traces poisoned, and verify steps did run there."""
    from mlaserve.runner import model_runner
    from tests.models.test_deepseek_v4 import StaticDecodeOnCPU

    path, options, want = model
    llm = LLM(str(path), **options, max_model_len=160, speculative_config=NGRAM)
    llm.engine.runner.graphs = StaticDecodeOnCPU(llm.engine.runner, 160, size=24)
    captured: list[bool] = []
    real = model_runner.run_captured

    def noted(graphs, batch, source, verify_rows, keep_prenorm, shift=None):  # noqa: ANN001, ANN202 - the runner's own call
        out = real(graphs, batch, source, verify_rows, keep_prenorm, shift)
        if verify_rows:
            captured.append(out is not None)
        return out

    monkeypatch.setattr(model_runner, "run_captured", noted)
    poison = Poison(llm)
    monkeypatch.setattr(Scheduler, "update_from_output", poison(Scheduler.update_from_output))
    assert tokens(llm.generate(prompts(), GREEDY, use_tqdm=False)) == want
    assert any(captured)
    check_stats(llm, poison)
