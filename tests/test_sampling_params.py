import math

import pytest

from mlaserve.outputs import CompletionOutput, RequestOutput
from mlaserve.sampling_params import SamplingParams


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens) == (1, 1.0, 1.0, 0, 16)
    assert p.stop == [] and p.stop_token_ids == []
    assert (p.ignore_eos, p.seed, p.logprobs) == (False, None, None)
    assert p.skip_special_tokens is True and p.include_stop_str_in_output is False
    assert not p.is_greedy


def test_stop_fields_are_normalised_to_lists() -> None:
    p = SamplingParams(stop="\n\n", stop_token_ids=(7, 9))
    assert p.stop == ["\n\n"]
    assert p.stop_token_ids == [7, 9]
    assert SamplingParams(stop=["a", "bc"]).stop == ["a", "bc"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0},
        {"temperature": 0.0, "top_k": -1},
        {"top_k": 1, "top_p": 1e-9},
        {"max_tokens": None},
        {"max_tokens": 1},
        {"logprobs": 0},
        {"seed": 0},
        {"stop_token_ids": [0]},
        {"n": 3, "temperature": 0},  # greedy n > 1 is allowed, as in vLLM
    ],
)
def test_edge_values_are_accepted(kwargs: dict) -> None:
    SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "field, value, allowed",
    [
        ("n", 0, ">= 1"),
        ("n", 2.0, "int"),
        ("n", True, "int"),
        ("temperature", -0.1, ">= 0"),
        ("temperature", math.inf, "finite"),
        ("temperature", math.nan, "finite"),
        ("temperature", "hot", ">= 0"),
        ("top_p", 0.0, "(0, 1]"),
        ("top_p", 1.5, "(0, 1]"),
        ("top_p", math.nan, "(0, 1]"),
        ("top_k", -2, "0 / -1"),
        ("top_k", 2.5, "int"),
        ("max_tokens", 0, ">= 1"),
        ("max_tokens", -3, ">= 1"),
        ("max_tokens", 4.0, "int"),
        ("logprobs", -1, ">= 0"),
        ("logprobs", True, "int"),
        ("seed", 1.5, "int"),
        ("seed", "42", "int"),
        ("stop", "", "non-empty"),
        ("stop", ["ok", ""], "non-empty"),
        ("stop", [3], "non-empty string"),
        ("stop_token_ids", [1, -1], ">= 0"),
        ("stop_token_ids", ["2"], "ints"),
    ],
)
def test_bad_values_raise_naming_field_and_range(field: str, value: object, allowed: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        SamplingParams(**{field: value})
    message = str(excinfo.value)
    assert message.startswith(field + " ")
    assert allowed in message
    assert repr(value if not isinstance(value, list) else value[-1]) in message


@pytest.mark.parametrize("temperature, greedy", [(0.0, True), (1e-6, True), (1e-5, False), (0.7, False)])
def test_is_greedy_uses_vllm_cutoff(temperature: float, greedy: bool) -> None:
    assert SamplingParams(temperature=temperature).is_greedy is greedy


def test_outputs() -> None:
    running = CompletionOutput(0, "Hi", [5, 6], -1.5, None, None)
    done = CompletionOutput(0, "Hi.", [5, 6, 2], -2.0, [{5: -0.5}, {6: -1.0}, {2: -0.5}], "stop", 2)
    assert not running.finished() and running.stop_reason is None
    assert done.finished() and done.stop_reason == 2
    out = RequestOutput("req-0", "Say hi", [1, 2, 3], [done], finished=True)
    assert out.num_cached_tokens == 0 and out.metrics is None
    assert out.outputs[0].token_ids == [5, 6, 2]
    assert "req-0" in repr(out)
