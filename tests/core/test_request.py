import ast
from pathlib import Path

import mlaserve.core
from mlaserve.core.request import Request, RequestStatus


def test_status_is_finished() -> None:
    finished = {s for s in RequestStatus if s.is_finished}
    assert finished == {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR,
    }
    assert RequestStatus.FINISHED_STOPPED.finish_reason == "stop"
    assert RequestStatus.FINISHED_LENGTH.finish_reason == "length"
    assert RequestStatus.FINISHED_ABORTED.finish_reason == "abort"
    assert RequestStatus.FINISHED_ERROR.finish_reason == "error"
    assert RequestStatus.RUNNING.finish_reason is None


def test_token_bookkeeping() -> None:
    req = Request(request_id="a", prompt_token_ids=[1, 2, 3], max_tokens=4, arrival_index=0)
    assert (req.num_tokens, req.num_prompt_tokens, req.num_output_tokens) == (3, 3, 0)
    all_ids = req.all_token_ids
    req.append_output_token(7)
    req.append_output_token(8)
    assert req.output_token_ids == [7, 8]
    assert req.all_token_ids == [1, 2, 3, 7, 8]
    assert req.all_token_ids is all_ids  # one list, appended to, never rebuilt
    assert req.prompt_token_ids == [1, 2, 3]
    assert (req.num_tokens, req.num_output_tokens) == (5, 2)
    assert req.num_cached_tokens == -1 and req.status is RequestStatus.WAITING and not req.is_finished
    req.status = RequestStatus.FINISHED_LENGTH
    assert req.is_finished


def test_identity_equality() -> None:
    a = Request(request_id="a", prompt_token_ids=[1], max_tokens=1, arrival_index=0)
    b = Request(request_id="a", prompt_token_ids=[1], max_tokens=1, arrival_index=0)
    assert a != b and len({a, b}) == 2


def test_core_never_imports_torch_or_numpy() -> None:
    for path in Path(mlaserve.core.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] not in {"torch", "numpy"}, f"{path.name} imports {name}"
