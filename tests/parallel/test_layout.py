"""What a tensor-parallel layout needs from a model's config (parallel/layout.py)."""

from types import SimpleNamespace

from mlaserve.parallel.layout import layout_problems


def test_every_width_that_does_not_divide_is_named() -> None:
    llama = SimpleNamespace(num_attention_heads=12, num_key_value_heads=3, intermediate_size=96)
    assert layout_problems(llama, 3, False) == []
    problems = layout_problems(llama, 2, False)
    assert (
        len(problems) == 1
        and "num_key_value_heads (3: KV heads are split" in problems[0]
        and "1, 3" in problems[0]
    )
    mla = SimpleNamespace(
        num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=64, intermediate_size=90
    )
    moe = dict(n_routed_experts=6, moe_intermediate_size=10, n_shared_experts=1)
    deepseek = SimpleNamespace(**vars(mla), **moe)
    assert layout_problems(deepseek, 2, False) == []  # the latent is not split: KV heads are not checked
    problems = layout_problems(deepseek, 4, False)
    assert [p.split(" does not divide ")[1].split(" (")[0] for p in problems] == [
        "intermediate_size",
        "moe_intermediate_size",
        "the shared experts' width",
    ]
    problems = layout_problems(deepseek, 4, True)  # whole experts per rank: 6 experts over 4 ranks
    assert any("n_routed_experts (6: " in p for p in problems)
    assert not any("moe_intermediate_size" in p for p in problems)
    assert layout_problems(llama, 3, True) == ["enable_expert_parallel: the model has no routed experts"]
