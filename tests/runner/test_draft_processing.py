"""Draft rows are processed as the plain engine processes the row after the drafts before them
(runner/draft_processing.py), on hand-made logits and a byte tokenizer's grammar."""

from __future__ import annotations

import pytest
import torch

from mlaserve.core.request import Request
from mlaserve.core.scheduler import ScheduledRequest
from mlaserve.outputs import Logprob
from mlaserve.runner.draft_processing import DraftGrammar, draft_grammars, kept_logprobs, process_draft_rows
from mlaserve.runner.spec_verify import accept_drafts
from mlaserve.sampling.logits_processors import process_logits_reference
from mlaserve.sampling_params import SamplingParams, StructuredOutputsParams

VOCAB = 40


def scheduled(rid: str, params: SamplingParams, outputs: list[int], drafts: list[int]) -> ScheduledRequest:
    request = Request(
        rid,
        [5, 6, 7, 30],
        max_tokens=32,
        arrival_index=0,
        eos_token_id=3,
        sampling_params=params,
        stop_token_ids=(9,),
    )
    request.output_token_ids = list(outputs)
    return ScheduledRequest(request, len(drafts) + 1, 4 + len(outputs), [], spec_token_ids=drafts)


def test_each_draft_row_counts_the_drafts_before_it() -> None:
    """Penalties and min_tokens on row j equal the definition's for a request whose outputs end with drafts 0..j-1:
    the would-be length crosses min_tokens inside the drafts, and the drafts repeat tokens the penalties count."""
    drafted = [
        scheduled(
            "a", SamplingParams(temperature=0, min_tokens=4, presence_penalty=0.9), [11, 12], [3, 9, 11, 3]
        ),
        scheduled("b", SamplingParams(temperature=0), [1], [2, 2]),
        scheduled(
            "c",
            SamplingParams(
                temperature=0.5, frequency_penalty=0.7, repetition_penalty=1.4, logit_bias={20: 1.5}
            ),
            [20],
            [20, 21, 20],
        ),
    ]
    logits = torch.randn(9, VOCAB, generator=torch.Generator().manual_seed(0))
    raw = logits.clone()
    out = process_draft_rows(logits, drafted, {})
    assert torch.equal(logits, raw)
    row = 0
    for s in drafted:
        for j in range(len(s.spec_token_ids)):
            params, request = s.request.sampling_params, s.request
            want = process_logits_reference(
                logits[row : row + 1], [params], [request], [None], None, [s.spec_token_ids[:j]]
            )
            torch.testing.assert_close(out[row : row + 1], want, rtol=0, atol=1e-6)
            row += 1
    # a: rows 0 and 1 (would-be lengths 2 and 3) hold EOS and the stop id back; rows 2 and 3 (4 and 5) do not
    assert [out[i, 3].item() == float("-inf") for i in range(4)] == [True, True, False, False]
    assert [out[i, 9].item() == float("-inf") for i in range(4)] == [True, True, False, False]


def test_accept_drafts_stops_where_the_grammar_does() -> None:
    """Drafts the grammar cannot take are never accepted, even where the target agrees with them: the token after
    the last valid draft is that row's target."""
    s = scheduled("g", SamplingParams(temperature=0), [1], [4, 5, 6])
    token_ids = {"g": 8}
    assert accept_drafts([s], [4, 5, 6], token_ids, {"g": 1}) == {"g": 1} and token_ids == {"g": 5}
    token_ids = {"g": 8}
    assert accept_drafts([s], [4, 5, 6], token_ids, {"g": 3}) == {"g": 3} and token_ids == {"g": 8}


def test_kept_logprobs_take_the_rows_of_the_kept_tokens() -> None:
    with_lp = scheduled("a", SamplingParams(temperature=0, logprobs=0), [1], [4, 5])
    without = scheduled("b", SamplingParams(temperature=0), [1], [6])
    rows = [{4: Logprob(-0.1, 1)}, {7: Logprob(-0.2, 1)}, None]
    sampled = {"a": {8: Logprob(-0.3, 1)}}
    assert kept_logprobs([with_lp, without], rows, {"a": 1, "b": 1}, sampled) == {"a": rows[:2]}
    assert kept_logprobs([with_lp, without], rows, {"a": 2, "b": 0}, sampled) == {
        "a": [*rows[:2], sampled["a"]]
    }


@pytest.fixture(scope="module")
def compiler(tmp_path_factory):
    from transformers import AutoTokenizer

    from mlaserve.sampling.structured_output import GrammarCompiler
    from mlaserve.testing.tiny_models import save_byte_tokenizer

    path = tmp_path_factory.mktemp("bytes")
    save_byte_tokenizer(path)
    compiler = GrammarCompiler(AutoTokenizer.from_pretrained(str(path)), 260)
    yield compiler
    compiler.shutdown()


def allowed(mask: torch.Tensor) -> set[int]:
    from mlaserve.sampling.logits_processors import unpack_bitmask

    return set(unpack_bitmask(mask, 258).nonzero().flatten().tolist())


def test_draft_masks_follow_the_drafts_and_leave_the_matcher_where_it_was(compiler) -> None:
    """regex a[bc]d: after "a" the grammar takes b or c, after "ab" only d. Drafts "a", "b", "x": two valid, then a
    draft it rejects; the matcher still stands at the start and takes the tokens it is then given."""
    ids = {c: compiler._ll().tokenize_str(c)[0] for c in "abcdx"}
    grammar = compiler.new(compiler.compile(StructuredOutputsParams(regex="a[bc]d")))
    drafted = [scheduled("g", SamplingParams(temperature=0), [], [ids["a"], ids["b"], ids["x"]])]
    walk = draft_grammars({"g": grammar}, drafted, 260)["g"]
    assert isinstance(walk, DraftGrammar) and walk.num_valid == 2
    sets = [allowed(walk.mask(j).bitmask) for j in range(4)]
    assert sets[0] == {ids["a"]} and sets[1] == {ids["b"], ids["c"]} and sets[2] == {ids["d"]}
    assert sets[3] == sets[2]  # past the rejected draft: the last state reached
    assert allowed(grammar.allowed_bitmask(260)) == {ids["a"]}
    assert grammar.accept(ids["a"]) and grammar.accept(ids["c"]) and grammar.error is None
