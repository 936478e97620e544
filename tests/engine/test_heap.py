import gc

from mlaserve import LLM, SamplingParams
from mlaserve.engine.heap import start_up_objects_frozen


def test_objects_are_frozen_for_the_run_and_given_back_after() -> None:
    assert gc.get_freeze_count() == 0
    before = [object() for _ in range(10)]
    with start_up_objects_frozen():
        assert gc.get_freeze_count() > len(before)
    assert gc.get_freeze_count() == 0


def test_a_freeze_made_by_someone_else_is_left_alone() -> None:
    gc.freeze()
    try:
        count = gc.get_freeze_count()
        with start_up_objects_frozen():
            assert gc.get_freeze_count() == count
        assert gc.get_freeze_count() == count  # not unfrozen on the way out
    finally:
        gc.unfreeze()


def test_generate_runs_its_steps_frozen_and_leaves_nothing_frozen(llama) -> None:
    llm = LLM(str(llama), dtype="float32", device="cpu", num_kv_blocks=16, max_model_len=64)
    seen = []
    step = llm.engine.step

    def counting_step(*args, **kwargs):
        seen.append(gc.get_freeze_count())
        return step(*args, **kwargs)

    llm.engine.step = counting_step
    llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3), use_tqdm=False)
    assert seen and min(seen) > 0  # every step ran with the start-up objects frozen
    assert gc.get_freeze_count() == 0
