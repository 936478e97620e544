"""Block-FP8 parameters: how a layer's FP8 weight and its scales take their part of a checkpoint.

A layer's weight may be fused from several checkpoint tensors (gate and up; q_a and kv_a) and split over ranks.
Each part lands in rows [offset, offset + size) of the weight, taken from rows [first, first + size) of its
checkpoint tensor, and the layer's columns are columns [col0, col0 + cols) of it. The scales follow the rows: in
DeepSeek's 128-row blocks where every part starts on a block row (group_n = 128), else one scale row per weight row
(group_n = 1), copied from the block each row belongs to, so no part is ever requantized. Columns are split only
on block boundaries; a split that would cut a block is refused when the layer is built, naming the widths.

A float tensor arriving for an FP8 weight (online quantization, or a layer the checkpoint left unquantized) is
quantized in blocks of its own rows and columns, and its scales count as loaded (`filled_shards`).
"""

from collections.abc import Hashable
from dataclasses import dataclass

import torch
from torch import nn

from mlaserve.config.quantization import BlockFP8Config
from mlaserve.layers.block_fp8 import BLOCK_N, FP8, blocks, quantize
from mlaserve.loader.checkpoint_slice import ShapeMismatch, check_shape, read


def group_rows(cfg: BlockFP8Config, part_rows: list[int], rows_split: bool) -> int:
    """128 where every part of the weight starts and ends on a 128-row block (the last part may end early when
    the rows are not split over ranks), else 1."""
    if cfg.block_n != BLOCK_N:
        return 1
    inner = part_rows if rows_split else part_rows[:-1]
    return BLOCK_N if all(n % BLOCK_N == 0 for n in inner) else 1


def check_column_split(cfg: BlockFP8Config, cols: int, ranks: int, what: str) -> None:
    """A checkpoint's FP8 columns split over ranks only on block boundaries (online quantization makes its own)."""
    if cfg.from_checkpoint and ranks > 1 and cols % cfg.block_k:
        total = cols * ranks
        whole = [n for n in range(1, total + 1) if total % n == 0 and (total // n) % cfg.block_k == 0] or [1]
        raise ValueError(
            f"{what}: its {total} input columns split over {ranks} ranks give {cols} per rank, which cuts the "
            f"checkpoint's {cfg.block_k}-column FP8 scale blocks; tensor_parallel_size values that keep them whole: "
            f"{whole}"
        )


def scale_param(rows: tuple[int, ...], cols: int, group_n: int, loader, shards: frozenset) -> nn.Parameter:
    """The float32 scales of an FP8 weight of `rows` (leading dims, then rows) x cols."""
    *lead, n = rows
    ones = torch.ones(*lead, blocks(n, group_n), blocks(cols, 128), dtype=torch.float32)
    param = nn.Parameter(ones, requires_grad=False)
    param.weight_loader = loader
    param.expected_shards = shards
    param.filled_shards = set()
    return param


@dataclass(frozen=True)
class Part:
    """Where one checkpoint tensor's slice lands (see the module docstring)."""

    offset: int  # first row in the layer's weight
    size: int  # rows
    first: int  # first row in the checkpoint tensor
    col0: int  # first column in the checkpoint tensor


def store_weight(
    weight: torch.Tensor,
    scale: nn.Parameter,
    scale_rows: torch.Tensor,
    loaded: torch.Tensor,
    part: Part,
    group_n: int,
    shard_id: Hashable,
) -> None:
    """loaded: the part's rows and the layer's columns, narrowed already. weight / scale_rows: this expert's (or
    the layer's) 2-D weight and scales; scale: the parameter, whose filled_shards record a quantized part."""
    target = weight.narrow(0, part.offset, part.size)
    check_shape(target, loaded, "FP8 weight")
    tensor = read(loaded)
    if tensor.dtype == FP8:
        target.copy_(tensor)
        return
    if tensor.dtype.is_floating_point and tensor.element_size() == 1:
        raise ShapeMismatch(f"checkpoint dtype {tensor.dtype}; FP8 weights are read as {FP8}")
    q, s = quantize(tensor.to(target.device), group_n if group_n > 1 else BLOCK_N)
    target.copy_(q)
    if group_n == 1:
        s = s.repeat_interleave(BLOCK_N, dim=0)[: part.size]
    scale_rows.narrow(0, part.offset // group_n, s.shape[0]).copy_(s)
    scale.filled_shards.add(shard_id)


def store_scale(
    scale_rows: torch.Tensor,
    loaded: torch.Tensor,
    part: Part,
    cols: int,
    full_shape: tuple[int, int],
    group_n: int,
    cfg: BlockFP8Config,
) -> None:
    """loaded: the checkpoint's whole scale tensor for the part's tensor of full_shape (rows, columns)."""
    want = (blocks(full_shape[0], cfg.block_n), blocks(full_shape[1], cfg.block_k))
    if tuple(loaded.shape) != want:
        raise ShapeMismatch(
            f"weight_scale_inv: checkpoint shape {tuple(loaded.shape)}, expected {want} "
            f"(blocks of {cfg.block_n}x{cfg.block_k} over a {full_shape[0]}x{full_shape[1]} weight)"
        )
    c0 = part.col0 // cfg.block_k
    scales = read(loaded.narrow(1, c0, blocks(part.col0 + cols, cfg.block_k) - c0)).float()
    if group_n == 1:
        rows = torch.arange(part.first, part.first + part.size) // cfg.block_n
        scale_rows.narrow(0, part.offset, part.size).copy_(scales[rows])
        return
    b0, nb = part.first // group_n, blocks(part.size, group_n)
    scale_rows.narrow(0, part.offset // group_n, nb).copy_(scales[b0 : b0 + nb])
