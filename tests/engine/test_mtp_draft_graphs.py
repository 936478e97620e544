"""The MTP draft pass of captured steps (runner/mtp_graphs.py) on CPU: decode and verify steps staged as the graphs
stage them (tests/runner/static_steps.py) and the draft pass run on the same static inputs, all but the capture.
Every pass's drafts are checked against the eager drafter's on the same step (the draft layer's cache put back
after the check, so the tokens still rest on the captured pass's cache rows alone); greedy tokens equal the plain
engine's and the blocks come back."""

from __future__ import annotations

import pytest
import torch

from mlaserve import LLM, SamplingParams
from mlaserve.runner import model_runner
from mlaserve.runner.mtp_draft import draft_spans
from mlaserve.runner.mtp_graphs import MtpDraftGraphs, collect_drafts
from mlaserve.testing.mtp_checkpoint import add_mtp_layer
from mlaserve.testing.tiny_models import build_tiny
from tests.engine.test_speculative_features import FEATURES, GRAMMARS, assert_same_outputs
from tests.engine.test_speculative_mtp import BASE, GREEDY, mtp, prompts, tokens
from tests.runner.static_steps import StaticStepsOnCPU

MAX_LEN = 128
SHORT = dict(max_num_batched_tokens=12, num_kv_blocks=20, max_model_len=64)


class CheckedDraftGraphs(MtpDraftGraphs):
    """The pass on the CPU stand-in's static inputs; each collection compares its drafts with the eager drafter's."""

    def __init__(self, runner, static: StaticStepsOnCPU) -> None:
        super().__init__(runner.drafter, static, static.max_model_len, torch.device("cpu"))
        self.runner = runner
        # per queued pass, its step's batch and hidden states: a step queued behind it may launch before it is read
        self.pending: dict[int, tuple] = {}
        self.compared: list[int] = []  # requests compared, per pass
        self.keys_run: set[tuple[int, int]] = set()  # (rows, chained rows) of each pass

    def forward(self, size: int, num_requests: int):
        self.keys_run.add((size, num_requests))
        return super().forward(size, num_requests)

    def launch(self, host, drafted, targets, sampled, num_valid, draft_ids=None):
        queued = super().launch(host, drafted, targets, sampled, num_valid, draft_ids)
        self.pending[id(queued)] = (host, self.source.prenorm.clone())
        return queued

    def check(self, queued, token_ids: dict[str, int], num_accepted: dict[str, int]) -> dict:
        got = collect_drafts(queued, token_ids, num_accepted)
        host, prenorm = self.pending.pop(id(queued))
        cache = self.kv_caches[-1]
        parts = cache if isinstance(cache, tuple) else (cache,)  # (K, V) under mla_disable
        saved = [part.clone() for part in parts]
        want = self.runner.drafter.propose(draft_spans(host, token_ids, num_accepted), prenorm)
        for part, kept in zip(parts, saved, strict=True):
            part.copy_(kept)
        assert got == want
        self.compared.append(len(want))
        return got


def captured(path, monkeypatch, **options) -> tuple[LLM, CheckedDraftGraphs]:
    options = {**BASE, "max_model_len": MAX_LEN, **options}
    llm = LLM(str(path), **options)
    max_model_len = options["max_model_len"]
    runner = llm.engine.runner
    static = runner.graphs = StaticStepsOnCPU(runner, max_model_len)
    graphs = runner.draft_graphs = CheckedDraftGraphs(runner, static)
    monkeypatch.setattr(model_runner, "collect_drafts", graphs.check)
    return llm, graphs


@pytest.mark.parametrize("echo", [False, True], ids=["random", "echo"])
@pytest.mark.parametrize("k", [1, 2])
def test_captured_drafts_equal_the_eager_drafters(mtp_models, monkeypatch, echo: bool, k: int) -> None:
    path, want = mtp_models[echo]
    llm, graphs = captured(path, monkeypatch, speculative_config=mtp(k))
    assert tokens(llm.generate(prompts(), GREEDY, use_tqdm=False)) == want
    stats = llm.stats()
    assert stats["num_draft_tokens"] > 0 and stats["kv_blocks_used"] == 0
    if echo:  # a cache row or hidden state from the wrong row would show as a rejected draft
        assert stats["num_accepted_tokens"] == stats["num_draft_tokens"]
    assert len(graphs.compared) >= 4 and max(graphs.compared) == len(prompts())
    assert any(chained < rows for rows, chained in graphs.keys_run)  # chained at the request count


def test_under_chunking_preemption_and_hits(mtp_models, monkeypatch) -> None:
    """Prompt chunks run the eager pass, decode and verify steps the captured one, over the same cache layer;
    recomputed requests and prefix hits read rows either wrote. Blocks this small also leave chained drafts
    without a slot, which both passes drop."""
    path, want = mtp_models[True]
    llm, graphs = captured(path, monkeypatch, **SHORT, speculative_config=mtp(2))
    outs = llm.generate(prompts(), GREEDY, use_tqdm=False)
    again = llm.generate(prompts(), GREEDY, use_tqdm=False)
    assert tokens(outs) == tokens(again) == want
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0 and stats["kv_blocks_used"] == 0
    assert stats["num_accepted_tokens"] == stats["num_draft_tokens"] > 0
    assert graphs.compared


def test_sampled_requests_draft_as_the_eager_drafter(mtp_models, monkeypatch) -> None:
    """Rejection sampling's targets (not the argmax) set where each request's accepted rows end."""
    path, _ = mtp_models[False]
    llm, graphs = captured(path, monkeypatch, speculative_config=mtp(2))
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=3)
    llm.generate(prompts(), params, use_tqdm=False)
    assert graphs.compared and llm.stats()["kv_blocks_used"] == 0


@pytest.fixture(scope="module")
def byte_echo(tmp_path_factory):
    """The echo layer on a byte-tokenizer model, which llguidance reads (structured outputs)."""
    plain = build_tiny("deepseek_v3", tmp_path_factory.mktemp("byte_v3"), tokenizer="bytes")
    return add_mtp_layer(plain, tmp_path_factory.mktemp("byte_v3_echo"), echo=True)


@pytest.mark.parametrize("feature", ["regex", "penalties"])
def test_grammars_and_penalties_through_the_captured_pass(byte_echo, monkeypatch, feature: str) -> None:
    """A grammar takes some drafts and not others (none past them is accepted, on the device too); penalties move
    the targets away from the echo layer's drafts."""
    batch = ["abcabcabcabcabc", "ab12ab12ab12ab12"]
    if feature == "regex":
        fields = dict(structured_outputs=GRAMMARS["regex"], logprobs=1)
    else:
        fields = dict(ignore_eos=True, **FEATURES["all_penalties"])
    params = SamplingParams(temperature=0, max_tokens=24, **fields)
    want = LLM(str(byte_echo), **{**BASE, "max_model_len": MAX_LEN}).generate(batch, params, use_tqdm=False)
    llm, graphs = captured(byte_echo, monkeypatch, speculative_config=mtp(2))
    assert_same_outputs(want, llm.generate(batch, params, use_tqdm=False))
    stats = llm.stats()
    assert graphs.compared and stats["num_draft_tokens"] > 0 and stats["kv_blocks_used"] == 0
