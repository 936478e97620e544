"""Whether a model can be split over `tensor_parallel_size` ranks: checked on its config before any process starts
or any weight loads, with every problem named at once."""

from __future__ import annotations

from mlaserve.layers.mxfp4 import GROUP as MXFP4_GROUP


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def mxfp4_width_problem(intermediate: int, size: int) -> str | None:
    """Why MXFP4 experts of width `intermediate` cannot be split by width over `size` ranks, or None. A rank's
    share of w2's input columns is stored as packed bytes (2 values each) and e8m0 scales (one per MXFP4_GROUP
    values): it must hold whole scale groups."""
    if size <= 1:
        return None
    # no split keeps its groups whole, and whole experts do not serve it either
    if intermediate % MXFP4_GROUP:
        return (
            f"MXFP4 experts need moe_intermediate_size to be a multiple of {MXFP4_GROUP} (one e8m0 scale per "
            f"{MXFP4_GROUP} inputs), got {intermediate}"
        )
    if intermediate % size:
        return f"tensor_parallel_size={size} does not divide moe_intermediate_size ({intermediate})"
    if (intermediate // size) % MXFP4_GROUP:
        whole = [
            d
            for d in range(1, intermediate + 1)
            if intermediate % d == 0 and (intermediate // d) % MXFP4_GROUP == 0
        ]
        return (
            f"moe_intermediate_size ({intermediate}) split over {size} ranks gives {intermediate // size} columns "
            f"per rank, which cuts the MXFP4 experts' {MXFP4_GROUP}-column e8m0 scale groups of w2; sizes that "
            f"keep them whole: {whole}, or enable_expert_parallel (whole experts per rank)"
        )
    return None


def layout_problems(
    cfg: object, size: int, expert_parallel: bool, fp8_block: int | None = None, mxfp4_experts: bool = False
) -> list[str]:
    """What does not divide: attention heads, KV heads, MLP widths, and the experts (whole experts per rank with
    expert parallelism, each expert's width otherwise). fp8_block: a block-FP8 checkpoint's scale-block width, which
    every rank's share of a split input width must be a whole number of. mxfp4_experts: the routed experts are
    MXFP4 (their split width must hold whole scale groups, and the FP8 blocks do not apply to them)."""

    def check(value: object, what: str, why: str = "") -> None:
        if isinstance(value, int) and value > 0 and value % size:
            problems.append(
                f"tensor_parallel_size={size} does not divide {what} ({value}{why}); sizes that do: {_divisors(value)}"
            )

    problems: list[str] = []
    check(getattr(cfg, "num_attention_heads", None), "num_attention_heads")
    # DeepSeek-V4: one kv head that every rank holds whole; its query heads split as whole output groups
    shared_kv = getattr(cfg, "o_groups", None) is not None
    if shared_kv:
        check(cfg.o_groups, "o_groups", ": each rank's heads are whole output groups")
    elif "num_key_value_heads" in vars(cfg) and getattr(cfg, "kv_lora_rank", None) is None:  # per-head K/V
        check(cfg.num_key_value_heads, "num_key_value_heads", ": KV heads are split, not replicated")
    check(getattr(cfg, "intermediate_size", None), "intermediate_size")
    experts = getattr(cfg, "n_routed_experts", None)
    if experts:
        if expert_parallel:
            check(experts, "n_routed_experts", ": expert parallelism puts whole experts on each rank")
        else:
            inter = getattr(cfg, "moe_intermediate_size", None)
            check(inter, "moe_intermediate_size")
            # a width that divides can still cut MXFP4's scale groups (one that does not is named above)
            if mxfp4_experts and isinstance(inter, int) and inter % size == 0:
                if (problem := mxfp4_width_problem(inter, size)) is not None:
                    problems.append(problem)
        shared = getattr(cfg, "n_shared_experts", None) or 0
        if shared:
            check(cfg.moe_intermediate_size * shared, "the shared experts' width")
    elif expert_parallel:
        problems.append("enable_expert_parallel: the model has no routed experts")
    if fp8_block and size > 1 and not problems:
        problems += _fp8_block_problems(cfg, size, not (expert_parallel or mxfp4_experts), fp8_block)
    return problems


def _fp8_block_problems(cfg: object, size: int, routed_split_fp8: bool, block: int) -> list[str]:
    """Row-parallel layers split their input columns: each rank's share must hold whole FP8 scale blocks."""
    heads = getattr(cfg, "num_attention_heads", 0) or 0
    head = (
        getattr(cfg, "v_head_dim", None) or getattr(cfg, "head_dim", None) or cfg.hidden_size // max(heads, 1)
    )
    # DeepSeek-V4: wo_b's input is the groups' low-rank outputs
    if getattr(cfg, "o_groups", None) is not None:
        output = ("wo_b's input (o_groups x o_lora_rank)", cfg.o_groups * cfg.o_lora_rank)
    else:
        output = ("o_proj's input (heads x head width)", heads * head)
    widths = [output, ("intermediate_size", getattr(cfg, "intermediate_size", None))]
    inter = getattr(cfg, "moe_intermediate_size", None)
    if getattr(cfg, "n_routed_experts", None) and inter:
        if routed_split_fp8:  # not whole experts per rank, nor MXFP4 experts (checked on their own)
            widths.append(("moe_intermediate_size", inter))
        widths.append(("the shared experts' width", inter * (getattr(cfg, "n_shared_experts", None) or 0)))
    problems = []
    for what, width in widths:
        if width and (width // size) % block:
            whole = [d for d in range(1, width + 1) if width % d == 0 and (width // d) % block == 0] or [1]
            problems.append(
                f"{what} ({width}) split over {size} ranks gives {width // size} columns per rank, which cuts the "
                f"checkpoint's {block}-column FP8 scale blocks; sizes that keep them whole: {whole}"
            )
    return problems
