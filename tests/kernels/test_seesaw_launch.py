"""gluon_seesaw.launch hands the Gluon kernel every argument under the name it expects, without a GPU: the kernel
is swapped for a recorder (Gluon kernels do not run under the interpreter), so a misordered argument list, the
classic first-run failure of a kernel never launched, shows here and not on the GPU."""

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402

from mlaserve.kernels.mla_decode import gluon_seesaw  # noqa: E402
from mlaserve.kernels.mla_decode.dispatch import KERNELS_BY_NAME, plan_for  # noqa: E402
from mlaserve.kernels.mla_decode.rules import DecodeCall, DecodeDevice  # noqa: E402
from mlaserve.kernels.mla_decode.tuning import tuned_plan  # noqa: E402
from mlaserve.testing.paged_case import LAT, ROPE, paged_case  # noqa: E402

H200 = DecodeDevice("sm_90", 132, triton=True, gluon=True)


class Recorder:
    """Stands in for stage1_seesaw: `kernel[grid](*args, **kwargs)` binds the call to the real kernel's parameter
    names and keeps it."""

    def __init__(self, kernel) -> None:
        self.names = kernel.arg_names
        self.calls: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid: tuple):
        def call(*args, **kwargs) -> None:
            assert len(args) + len(kwargs) == len(self.names) + 1, (len(args), sorted(kwargs))  # + num_warps
            bound = dict(zip(self.names, args, strict=False))
            assert not set(bound) & set(kwargs)
            self.calls.append((grid, {**bound, **kwargs}))

        return call


@pytest.mark.parametrize("tma, prefetch", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("block_n", [32, 64])
def test_launch_binds_every_argument_by_name(monkeypatch, tma, prefetch, block_n):
    lengths = [5, 300, 70]
    q, cache, table, meta = paged_case(len(lengths), 96, lengths, 64, torch.bfloat16, seed=0, device="cpu")
    q_lat, q_pe = q[..., :LAT], q[..., LAT:]
    plan = tuned_plan(
        *_described(q, cache), "gluon_seesaw", block_n=block_n, tma=tma, prefetch=prefetch, num_splits=3
    )
    recorder = Recorder(gluon_seesaw.stage1_seesaw)
    monkeypatch.setattr(gluon_seesaw, "stage1_seesaw", recorder)
    monkeypatch.setattr(gluon_seesaw, "merge", lambda plan, step, *rest: step)
    step = gluon_seesaw.launch(plan, q_lat, q_pe, cache, table, meta.seq_lens, LAT, 0.07)
    ((grid, args),) = recorder.calls
    assert grid == (len(lengths), 2, 3)  # sequences, groups of 64 heads (96 -> 2), splits
    assert args["Q"] is q_lat and args["QPe"] is q_pe and args["KV"] is step.kv
    assert (args["BlockTable"], args["SeqLens"]) == (table, meta.seq_lens)
    assert args["MidO"] is step.mid_o and args["MidLse"] is step.mid_lse
    assert (args["stride_qb"], args["stride_qh"]) == q_lat.stride()[:2]
    assert (args["stride_pb"], args["stride_ph"]) == q_pe.stride()[:2]
    assert args["stride_kv"] == LAT + ROPE and args["stride_bt"] == table.stride(0)
    assert (args["stride_mob"], args["stride_moh"], args["stride_mos"]) == step.mid_o.stride()[:3]
    assert (args["num_heads"], args["num_splits"]) == (96, 3)
    assert args["scale_log2"] == pytest.approx(0.07 * 1.4426950408889634)
    assert (args["PAGE"], args["D_LAT"], args["D_ROPE"], args["BLOCK_H"]) == (64, LAT, ROPE, 64)
    assert (args["BLOCK_N"], args["TMA"], args["PREFETCH"], args["num_warps"]) == (block_n, tma, prefetch, 4)
    lat, pe = args["DescLat"], args["DescPe"]
    assert isinstance(lat, TensorDescriptor) and isinstance(pe, TensorDescriptor)
    assert lat.block_shape == [LAT // 64, block_n, 64] and pe.block_shape == [block_n, ROPE]
    # with TMA the boxes are copied from the cache's rows; without, the kernel reads neither
    assert (lat.base is step.kv and pe.base is step.kv) == tma


def _described(q: torch.Tensor, cache: torch.Tensor):
    """The call's shape and step as the engine reads them, on an sm_90 device (this machine has none)."""
    from mlaserve.kernels.mla_decode.decode import describe_call

    shape, call, _ = describe_call(q, cache, 400, LAT, ROPE)
    return shape, DecodeCall(call.batch, call.max_seq_len), H200


def test_the_table_entry_launches_through_this_module():
    kernel = KERNELS_BY_NAME["gluon_seesaw"]
    q, cache, _, _ = paged_case(2, 128, [3, 9], 16, torch.bfloat16, seed=1, device="cpu")
    plan = plan_for(kernel, *_described(q, cache))
    assert plan.kernel == "gluon_seesaw" and kernel.launch.module == gluon_seesaw.__name__
