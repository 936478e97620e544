import gc

from mlaserve import LLM, SamplingParams
from mlaserve.engine import heap
from mlaserve.engine.heap import start_up_objects_frozen


def test_objects_are_frozen_for_the_run_and_given_back_after() -> None:
    assert gc.get_freeze_count() == 0
    before = [[i] for i in range(1000)]  # lists: objects the collector tracks
    with start_up_objects_frozen():
        assert gc.get_freeze_count() > len(before)
    assert gc.get_freeze_count() == 0


def test_a_few_objects_frozen_earlier_do_not_keep_the_rest_in_sight() -> None:
    # A library may freeze a few objects at import (the GPU image had 375 frozen): the run still freezes the rest.
    gc.freeze()
    earlier = gc.get_freeze_count()
    made_since = [[i] for i in range(1000)]
    with start_up_objects_frozen():
        assert gc.get_freeze_count() >= earlier + len(made_since)
    assert gc.get_freeze_count() == 0  # one frozen generation: what was frozen before is returned too


def test_a_freeze_for_good_is_left_alone(monkeypatch) -> None:
    gc.freeze()
    # As freeze_start_up_objects leaves it, without its collect.
    monkeypatch.setattr(heap, "_frozen_for_good", True)
    try:
        count = gc.get_freeze_count()
        made_since = [[i] for i in range(1000)]

        def untouched() -> bool:
            # Neither frozen again (the 1,000 lists made since would join) nor unfrozen (0). Not equality: a frozen
            # object still goes when its last reference does, and other threads of the test process drop some.
            return count - len(made_since) // 2 < gc.get_freeze_count() < count + len(made_since) // 2

        with start_up_objects_frozen():
            assert untouched()
        assert untouched()  # not unfrozen on the way out
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


def test_a_slow_full_collection_is_logged(caplog) -> None:
    watch = heap._SlowCollections(threshold_ms=0.0)
    gc.callbacks.append(watch)
    try:
        with caplog.at_level("WARNING", logger="mlaserve.engine.heap"):
            gc.collect(1)  # a young collection is not reported
            assert not caplog.records
            gc.collect()
    finally:
        gc.callbacks.remove(watch)
    assert len(caplog.records) == 1 and "full garbage collection took" in caplog.records[0].getMessage()
