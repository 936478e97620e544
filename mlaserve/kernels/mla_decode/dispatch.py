"""Which paged MLA decode kernel runs a call: an ordered table in which every kernel declares what it supports and
when it pays; the first that fits and pays takes the call. The Triton kernel takes any heads and page size, latent
ranks up to 1,024 and rotary widths up to 256, wherever Triton runs, and the torch reference anything at all, so
every shape has a kernel; the start-up log and stats() name it (`describe`).

Each entry has kernel.py's shape and is data: what it supports (support.py: the runtime and GPU generations it
needs, cache and query dtypes, the widths it takes), a static `pays` rule and, where the choice depends on the step
(batch, context), a per-call one, and the launch of its plans (a module's `launch`, imported on first use). Tuning
knobs are not part of the engine's call: benchmarks reach them through tuning.py, which names a kernel and passes
the knobs listed here in `tunables`.
"""

import dataclasses
import functools
import os
from collections.abc import Callable, Mapping
from types import MappingProxyType

import torch

from mlaserve.kernels import fit
from mlaserve.kernels.kernel import Kernel, Lazy
from mlaserve.kernels.mla_decode import rules
from mlaserve.kernels.mla_decode.rules import DecodeCall, DecodeDevice, DecodePlan, DecodeShape
from mlaserve.kernels.mla_decode.support import ANY, EIGHT_BIT, FLOATS, HALF, DecodeSupport, Widths


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class DecodeKernel(Kernel):
    """A decode kernel (kernel.py's shape): `supports` is its DecodeSupport, `pays` its static rule over (shape,
    device), `launch` runs a plan over (q, q_pe, kv_cache, block_table, seq_lens, kv_lora_rank, scale), `plan` makes
    that plan from the shape, the step and the device (and a benchmark's tuning, tuning.py), `shared_bytes` says
    what one of its programs takes of the device's shared memory."""

    supports: DecodeSupport
    about: str
    plan: Callable[[DecodeShape, DecodeCall, DecodeDevice, Mapping[str, object]], DecodePlan]
    shared_bytes: Callable[[DecodePlan, DecodeShape], int]  # one program's shared memory at a plan's tile
    # where the choice depends on the step: pays only for the calls this says yes to, a rule named by pays_when
    pays_per_call: Callable[[DecodeShape, DecodeCall, DecodeDevice], bool] | None = None
    pays_when: str = ""
    tunables: frozenset[str] = frozenset({"num_splits", "partial_dtype"})
    tma_rows: bool = False  # copies rows with TMA: 16-byte aligned rows
    # spare splits for long sequences (rules.grid_splits); the kernel ends a program past its sequence's share at
    # once
    grid_room: bool = True
    windows: bool = False  # reads a window's rows from where it starts (DecodeCall.window)


def _launch(module: str) -> Lazy:
    return Lazy(f"mlaserve.kernels.mla_decode.{module}", "launch")


# What the Gluon kernels share: Hopper, a 16-bit query, any heads (in groups). The 8-bit kernels were measured with
# 64-row tiles inside a page (the fp8-dot one copies them by TMA); the 16-bit one looks up each row's page where a
# tile spans pages (sparse attention's pages of one row).
GLUON = dict(runtime="gluon", archs=frozenset({"sm_90"}), query_dtypes=HALF, heads=ANY)
TRITON_TUNABLES = frozenset({"block_h", "block_n", "num_warps", "num_stages", "num_splits", "prefetch", "page_ahead",
                             "q_f16", "widen_bits", "partial_dtype", "balanced", "min_span_rows"})  # fmt: skip

# Ordered: the first kernel that fits a call and pays runs it. The Gluon kernels' widths are those that built and
# matched the reference on Hopper: rope tiles narrower than 64 (32 for fp8 dots) break their 128-byte swizzled
# layouts, and the 16-bit kernel's shared memory overflows at rank 512 with rope 128.
DECODE_KERNELS: tuple[DecodeKernel, ...] = (
    DecodeKernel(
        "gluon_fp8", about="fp8 cache, both dots on fp8 tensor cores (gluon_fp8.py)",
        supports=DecodeSupport(**GLUON, cache_dtypes=frozenset({torch.float8_e4m3fn}), ranks=Widths(512, 512),
                               ropes=Widths(32, 128, pow2=True), pages=Widths(multiple_of=64)),
        pays=rules.few_heads, pays_per_call=rules.fp8_dots_pay_for, pays_when="fp8_dots_pay",
        launch=_launch("gluon_fp8"), plan=rules.plan_gluon_fp8, shared_bytes=rules.gluon_fp8_shared_bytes,
        tunables=frozenset({"num_splits", "partial_dtype", "pdl"}), tma_rows=True,
    ),
    DecodeKernel(
        "gluon_wgmma8", about="8-bit cache widened in wgmma's operand registers (gluon_wgmma8.py)",
        supports=DecodeSupport(**GLUON, cache_dtypes=EIGHT_BIT, ranks=Widths(512, 512),
                               ropes=Widths(64, 128, pow2=True), pages=Widths(multiple_of=64)),
        pays=rules.fp8_widening_pays, launch=_launch("gluon_wgmma8"), plan=rules.plan_gluon_wgmma8,
        shared_bytes=rules.gluon_wgmma8_shared_bytes,
    ),
    DecodeKernel(
        "gluon_seesaw", about="16-bit cache, 64 heads per program, warpgroups take alternate tiles' scores "
                              "(gluon_seesaw.py; off by default: rules.SEESAW_BY_DEFAULT)",
        supports=DecodeSupport(**GLUON, cache_dtypes=HALF, ranks=Widths(512, 512), ropes=Widths(64, 64), pages=ANY),
        pays=rules.seesaw_pays, launch=_launch("gluon_seesaw"), plan=rules.plan_gluon_seesaw,
        shared_bytes=rules.gluon_seesaw_shared_bytes,
        tunables=frozenset({"num_splits", "partial_dtype", "block_n", "tma", "prefetch"}),
    ),
    DecodeKernel(
        "gluon_wgmma", about="16-bit cache, 64 heads per program, warpgroups split the scores (gluon_wgmma.py)",
        supports=DecodeSupport(**GLUON, cache_dtypes=HALF, ranks=Widths(64, 512, pow2=True), ropes=Widths(64, 64),
                               pages=ANY),
        pays=rules.many_heads, launch=_launch("gluon_wgmma"), plan=rules.plan_gluon_wgmma,
        shared_bytes=rules.gluon_wgmma_shared_bytes,
    ),
    DecodeKernel(
        "triton", about="general: any heads, widths and page, tiles padded to powers of two (triton_split.py)",
        supports=DecodeSupport(runtime="triton", archs=None, cache_dtypes=FLOATS | EIGHT_BIT, query_dtypes=FLOATS,
                               heads=ANY, ranks=Widths(1, 1024), ropes=Widths(0, 256), pages=ANY),
        pays=rules.always, launch=_launch("triton_split"), plan=rules.plan_triton, tunables=TRITON_TUNABLES,
        shared_bytes=rules.triton_shared_bytes, windows=True,
    ),
    DecodeKernel(
        "torch reference", about="plain torch over whole block tables (reference.py)",
        supports=DecodeSupport(runtime="torch", archs=None, cache_dtypes=None, query_dtypes=None, heads=ANY,
                               ranks=ANY, ropes=Widths(0), pages=ANY),
        pays=rules.always, launch=_launch("reference"), plan=rules.plan_torch, tunables=frozenset(),
        shared_bytes=rules.no_shared_bytes,
        grid_room=False, windows=True,
    ),
)  # fmt: skip
KERNELS_BY_NAME = {kernel.name: kernel for kernel in DECODE_KERNELS}


@functools.cache
def decode_device(device: torch.device) -> DecodeDevice:
    """What `device` offers the decode kernels (see DecodeDevice)."""
    if device.type != "cuda":
        return DecodeDevice(None, 4, os.environ.get("TRITON_INTERPRET") == "1" and _has_triton(), False)
    major, minor = torch.cuda.get_device_capability(device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    arch = f"sm_{major}{minor}"
    gluon = arch == "sm_90" and _has_gluon()
    return DecodeDevice(arch, sms, _has_triton(), gluon, fit.shared_memory_limit(device))


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _has_gluon() -> bool:
    """Gluon is experimental: a Triton without what the kernels use keeps the Triton kernel."""
    try:
        from mlaserve.kernels.mla_decode import gluon_fp8, gluon_seesaw, gluon_wgmma, gluon_wgmma8  # noqa: F401
    except (ImportError, AttributeError):
        return False
    return True


def refusal(kernel: DecodeKernel, shape: DecodeShape, call: DecodeCall, device: DecodeDevice) -> str | None:
    """None where `kernel` can run the call (pays rules aside), else why not."""
    why = kernel.supports(shape, device)
    if why is None and kernel.tma_rows and not call.tma_rows:
        why = "copies rows by TMA: the cache's rows must start 16-byte aligned"
    if why is None and call.window and not kernel.windows:
        why = "reads every row from the first: no window"
    return why


@functools.cache
def candidates(shape: DecodeShape, device: DecodeDevice, window: bool = False) -> tuple[DecodeKernel, ...]:
    """The kernels that fit `shape` and pay for it, in table order, up to the first that pays for every call; with
    `window`, only those that read a window (DecodeCall.window)."""
    found = []
    for kernel in DECODE_KERNELS:
        if window and not kernel.windows:
            continue
        if kernel.supports(shape, device) is None and kernel.pays(shape, device):
            found.append(kernel)
            if kernel.pays_per_call is None:
                break
    return tuple(found)


def choose_kernel(shape: DecodeShape, call: DecodeCall, device: DecodeDevice) -> DecodeKernel:
    """The first kernel in DECODE_KERNELS that fits the call and pays for it."""
    for kernel in candidates(shape, device, bool(call.window)):
        if kernel.tma_rows and not call.tma_rows:
            continue
        if kernel.pays_per_call is None or kernel.pays_per_call(shape, call, device):
            return kernel
    # not reached while the torch reference, which takes every call, ends the table
    raise RuntimeError(f"no decode kernel takes {describe_shape(shape, device)}")  # pragma: no cover


@functools.lru_cache(maxsize=4096)
def default_plan(shape: DecodeShape, call: DecodeCall, device: DecodeDevice) -> DecodePlan:
    """The engine's plan: the dispatcher's kernel at its defaults. Every layer of a step makes the same call, so all
    but the first find it here."""
    return plan_for(choose_kernel(shape, call, device), shape, call, device)


def plan_for(
    kernel: DecodeKernel,
    shape: DecodeShape,
    call: DecodeCall,
    device: DecodeDevice,
    tuning: Mapping[str, object] = MappingProxyType({}),
) -> DecodePlan:
    """`kernel`'s launch of one call, with a benchmark's `tuning` (tuning.py) over its defaults; the grid gets room
    for long sequences where the kernel takes it."""
    planned = dataclasses.replace(kernel.plan(shape, call, device, tuning), window=call.window)
    if not kernel.grid_room or "num_splits" in tuning or planned.balanced:
        return planned
    room = rules.grid_splits(
        planned.num_splits, call.batch, shape.num_heads, shape.kv_lora_rank, call.max_seq_len
    )
    return dataclasses.replace(planned, num_splits=room, split_target=planned.num_splits)


def plan_shared_bytes(plan: DecodePlan, shape: DecodeShape) -> int:
    """The shared memory one program of `plan` takes, by its kernel's estimate."""
    return KERNELS_BY_NAME[plan.kernel].shared_bytes(plan, shape)


@functools.lru_cache(maxsize=4096)
def default_ladder(shape: DecodeShape, call: DecodeCall, device: DecodeDevice) -> tuple[DecodePlan, ...]:
    """The engine's plan, then what runs the call if its kernel cannot be built on the device (kernels/fit.py):
    a Gluon kernel's fixed tile gives way to the Triton kernel's plan, and that to smaller tiles."""
    first = default_plan(shape, call, device)
    if first.kernel == "torch reference":
        return (first,)
    general = first if first.kernel == "triton" else plan_for(KERNELS_BY_NAME["triton"], shape, call, device)
    rungs = fit.ladder(general, _smaller_triton_plan)
    return rungs if general is first else (first, *rungs)


def _smaller_triton_plan(p: DecodePlan) -> DecodePlan | None:
    """Fewer rows per tile (a tile inside a page stays inside it), then fewer heads per program, then one tile
    buffer, then no register prefetch: each takes less shared memory or fewer registers."""
    if p.block_n > 16:
        return dataclasses.replace(p, block_n=p.block_n // 2)
    if p.block_h > 16:
        return dataclasses.replace(p, block_h=p.block_h // 2)
    if p.num_stages > 1:
        return dataclasses.replace(p, num_stages=1)
    if p.prefetch:
        return dataclasses.replace(p, prefetch=False)
    return None


def describe(shape: DecodeShape, device: DecodeDevice) -> str:
    """The kernel that runs `shape` on `device`, for the start-up log and stats(): one name, or where the choice
    depends on the step, "A where <rule>, else B"."""
    found = candidates(shape, device)
    parts = [f"{k.name} where {k.pays_when}" if k.pays_per_call else k.name for k in found]
    return ", else ".join(parts)


def describe_shape(shape: DecodeShape, device: DecodeDevice) -> str:
    dtype = str(shape.cache_dtype).removeprefix("torch.")
    return (f"{shape.num_heads} heads x ({shape.kv_lora_rank} latent + {shape.rope_dim} rope), {dtype} cache, "
            f"pages of {shape.block_size} on {device.arch or 'cpu'}")  # fmt: skip
