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


def test_mxfp4_experts_split_by_width_need_whole_scale_groups_per_rank() -> None:
    v4 = SimpleNamespace(num_attention_heads=12, o_groups=6, n_routed_experts=16, moe_intermediate_size=96)
    assert layout_problems(v4, 2, False) == []  # bf16 experts: any width that divides
    (problem,) = layout_problems(v4, 2, False, mxfp4_experts=True)
    assert "moe_intermediate_size (96) split over 2 ranks gives 48 columns" in problem
    assert "sizes that keep them whole: [1, 3]" in problem
    assert layout_problems(v4, 2, True, mxfp4_experts=True) == []  # whole experts per rank
    assert layout_problems(v4, 3, False, mxfp4_experts=True) == []
    # named beside the other widths that do not divide, not in place of them
    problems = layout_problems(SimpleNamespace(**{**vars(v4), "o_groups": 3}), 2, False, mxfp4_experts=True)
    assert len(problems) == 2 and "o_groups (3" in problems[0] and "48 columns per rank" in problems[1]
    # V4-Flash's widths over 8 ranks: 256 columns of each expert per rank, whole 32-column scale groups; the
    # routed experts are MXFP4, so the checkpoint's 128-column FP8 blocks do not apply to them
    flash = SimpleNamespace(
        num_attention_heads=64,
        o_groups=8,
        o_lora_rank=1024,
        hidden_size=4096,
        head_dim=512,
        n_routed_experts=256,
        moe_intermediate_size=2048,
        n_shared_experts=1,
    )
    assert layout_problems(flash, 8, False, 128, mxfp4_experts=True) == []
    changed = dict(
        num_attention_heads=10, o_groups=5, o_lora_rank=128, moe_intermediate_size=160, n_shared_experts=0
    )
    odd = SimpleNamespace(**{**vars(flash), **changed})
    assert layout_problems(odd, 5, False, 128, mxfp4_experts=True) == []  # 32 columns per rank
    assert any("128-column FP8" in p for p in layout_problems(odd, 5, False, 128))  # FP8 experts would cut


def test_an_mxfp4_width_no_split_can_serve_is_named_as_such() -> None:
    """48 is no multiple of 32: no tensor-parallel size keeps its scale groups whole, and whole experts per rank do
    not serve it either, so the refusal names the width's own problem instead of an empty list of sizes."""
    v4 = SimpleNamespace(num_attention_heads=12, o_groups=6, n_routed_experts=16, moe_intermediate_size=48)
    (problem,) = layout_problems(v4, 2, False, mxfp4_experts=True)
    assert "multiple of 32" in problem and "48" in problem
    assert "[]" not in problem and "enable_expert_parallel" not in problem
