"""CoreOutput crosses the pipe between the engine core and the API servers: its pickling keeps every field."""

import dataclasses
import pickle

from mlaserve.engine.core_output import CoreOutput


def test_pickle_round_trip_keeps_every_field() -> None:
    # every field away from its default, so a field that __reduce__ forgets (or swaps) shows
    values = {
        "request_id": "cmpl-1",
        "new_token_ids": [5, 6],
        "new_logprobs": [{5: -0.5}, {6: -0.25}],
        "finish_reason": "stop",
        "stop_reason": 7,
        "prompt_logprobs": [None, {3: -1.0}],
        "num_cached_tokens": 16,
        "metrics": {"arrival_time": 1.5},
    }
    assert sorted(values) == sorted(f.name for f in dataclasses.fields(CoreOutput))
    output = CoreOutput(**values)
    copy = pickle.loads(pickle.dumps(output, protocol=pickle.HIGHEST_PROTOCOL))
    assert dataclasses.asdict(copy) == values
