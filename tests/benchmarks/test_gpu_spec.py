"""benchmarks/gpu_spec.py's code path at tiny sizes on CPU: a tiny DeepSeek-V3 with an MTP layer, its steps run
through the captured-step stand-in (tests/runner/static_steps.py), every (batch, k) row timed and its speedups
following from the acceptance rates; and the verify step the section times gives the plain decode's logits at its
first row of each request (the same position and context)."""

import time

import pytest
import torch

from benchmarks import gpu_spec as section
from mlaserve import LLM
from mlaserve.runner.mtp_graphs import MtpDraftGraphs
from mlaserve.runner.verify_graphs import verify_as_decodes
from mlaserve.testing.mtp_checkpoint import add_mtp_layer
from mlaserve.testing.tiny_models import build_tiny
from tests.runner.static_steps import StaticStepsOnCPU

MAX_LEN = 64


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = add_mtp_layer(
        build_tiny("deepseek_v3", tmp_path_factory.mktemp("v3")), tmp_path_factory.mktemp("mtp")
    )
    llm = LLM(str(path), dtype="float32", device="cpu", block_size=4, num_kv_blocks=256, max_model_len=MAX_LEN,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})  # fmt: skip
    runner = llm.engine.runner
    runner.graphs = StaticStepsOnCPU(runner, MAX_LEN, sizes=(1, 2, 4, 8, 16))
    runner.draft_graphs = MtpDraftGraphs(runner.drafter, runner.graphs, MAX_LEN, torch.device("cpu"))
    return llm


def cpu_ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - start)


def test_the_section_times_every_row(llm):
    rows = section.time_model(llm, cpu_ms, cpu_ms, batches=(1, 3), ks=(1, 2), context=20)
    assert [(r["batch"], r["k"]) for r in rows] == [(1, 1), (1, 2), (3, 1), (3, 2)]
    for r in rows:
        assert r["decode_ms"] > 0 and r["verify_ms"] > 0 and r["mtp_draft_ms"] > 0
        assert r["mtp_draft_graph_ms"] > 0 and r["mtp_draft_launch_ms"] > 0
        for name, a in section.ACCEPTANCE.items():
            tokens = sum(a**j for j in range(r["k"] + 1))
            assert r["expected_tokens"][name] == pytest.approx(tokens)
            assert r["speedup"][name] == pytest.approx(tokens * r["decode_ms"] / r["verify_ms"])
    assert set(section.SOURCES) == set(section.ACCEPTANCE)


def test_the_timed_verify_step_is_the_decode_step_at_each_requests_first_row(llm):
    """Same known tokens, blocks and position: a request's first verify row is the plain decode step's row (what the
    section divides by is the same step with drafts added)."""
    graphs, vocab = llm.engine.runner.graphs, llm.engine.model_config.hf_config.vocab_size
    want = graphs.run(section.step_batch(3, 0, 20, 4, vocab)).clone()
    got = graphs.run(verify_as_decodes(section.step_batch(3, 2, 20, 4, vocab)))
    assert got.shape[0] == 9
    torch.testing.assert_close(got[::3], want, rtol=1e-5, atol=1e-5)


def test_the_timed_draft_pass_drafts_as_the_eager_one(llm):
    """The captured pass the section times, after a verify step that accepted every draft, gives the eager
    drafter's drafts on the spans the section times it on."""
    runner, vocab = llm.engine.runner, llm.engine.model_config.hf_config.vocab_size
    host = section.step_batch(3, 2, 20, 4, vocab)
    _, prenorm = section.staged(runner.graphs, verify_as_decodes(host))
    _, launch = section.staged_draft_pass(runner.draft_graphs, host)
    # the section's requests do not ask for drafts (collect_drafts would drop them): the pass's rows themselves
    got = launch().drafts[:3].tolist()
    want = runner.drafter.propose(section.draft_spans(host, 20), prenorm)
    assert got == [want[s.request.request_id][1] for s in host.order]
