"""EngineCore: model, KV cache, scheduler and runner wired together; token ids in, token-id deltas out.

The core knows no text: each step returns a CoreOutput per request that got a token (the new ids, their logprobs,
and how it finished), never a cumulative copy. Detokenization and stop strings belong to the OutputProcessor
(output_processor.py) of whoever reads the deltas: LLMEngine in-process, or the server in another process.
"""

import dataclasses
import itertools
import logging
import time
import weakref

import torch

from mlaserve.attention.pooled_window import PooledWindow
from mlaserve.attention.selector import attention_kernel, select_backend
from mlaserve.config.engine_config import EngineConfig
from mlaserve.config.model_config import ModelConfig
from mlaserve.conversion.folder import apply_saved_conversion, saved_conversion
from mlaserve.core.kv_cache_manager import CacheGroupSpec, KVCacheManager
from mlaserve.core.request import Request, RequestStatus
from mlaserve.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from mlaserve.engine.core_output import CoreOutput
from mlaserve.engine.intake import PreparedRequest, RequestIntake
from mlaserve.engine.kv_sizing import num_kv_blocks
from mlaserve.engine.option_checks import check_engine_options
from mlaserve.engine.step_trace import trace
from mlaserve.engine.structured_output import GrammarCompiler
from mlaserve.kvcache.allocate import allocate_kv_caches
from mlaserve.kvcache.quant import resolve_cache_dtype
from mlaserve.kvcache.spec import FULL, AttentionRule, KVCacheSpec
from mlaserve.loader.model_files import resolve_model
from mlaserve.loader.model_loader import build_model
from mlaserve.loader.tokenizer import load_tokenizer
from mlaserve.parallel import SINGLE, ParallelContext
from mlaserve.parallel.workers import WorkerDied, Workers
from mlaserve.runner.model_runner import LaunchedStep, ModelRunner, StepResult
from mlaserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} requested but no CUDA device is available; use device='cpu'")
    return device


def with_sliding_window(spec: KVCacheSpec, window: int | None, sinks: int) -> KVCacheSpec:
    """The training-free window option: every full-attention layer takes (window, sinks); layers the model itself
    windows keep their own rule."""
    if window is None:
        return spec
    layers = [
        dataclasses.replace(layer, window=window, sinks=sinks) if layer.window is None else layer
        for layer in spec.layers
    ]
    return dataclasses.replace(spec, layers=tuple(layers))


def _with_saved_conversion(config: EngineConfig, saved: dict) -> EngineConfig:
    """A converted folder serves as converted: enable_mla and the skipped layers come from its config.json."""
    given = [name for name in ("mla_latent_dim", "qk_rope_head_dim") if getattr(config, name) is not None]
    if given or config.mla_skip_layers or config.mla_rank_allocation != "uniform":
        raise ValueError(
            f"{config.model} was converted by `mlaserve convert` (config.json's mlaserve_mla section); it takes no "
            f"conversion options of its own ({', '.join(given) or 'mla_skip_layers / mla_rank_allocation'})"
        )
    return dataclasses.replace(
        config, enable_mla=True, mla_skip_layers=tuple(saved.get("mla_skip_layers", ()))
    )


def stop_ranks(workers: Workers | None, parallel: ParallelContext) -> None:
    """Send the other ranks the stop, wait for them (killing any of ours that hang) and leave the process group.
    workers: None when a launcher (torchrun) started the ranks."""
    from mlaserve.parallel.group import broadcast_object, destroy, leave

    if workers is None or workers.dead is None:
        try:
            broadcast_object(parallel, None)
            leave(parallel)
        except Exception:  # noqa: BLE001 - a rank already gone; stop() kills the rest
            logger.warning("tensor-parallel ranks did not take the stop; killing them")
    if workers is not None:
        workers.stop()
    destroy()


def _launched_rank(size: int) -> int:
    """This process's rank, from the launcher's environment (torchrun sets RANK and WORLD_SIZE)."""
    import os

    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        raise ValueError(
            "distributed_executor_backend='external_launcher' runs under torchrun (or a launcher that sets RANK, "
            "WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT); they are not set"
        ) from None
    if world != size:
        raise ValueError(
            f"tensor_parallel_size={size}, but the launcher started {world} processes (WORLD_SIZE)"
        )
    return rank


class EngineCore:
    def __init__(self, config: EngineConfig, tp_rank: int = 0, init_method: str | None = None) -> None:
        """tp_rank and init_method: a tensor-parallel rank past 0 (parallel/worker.py); rank 0 starts those."""
        self.config = config
        self.device = resolve_device(config.device)
        self.workers: Workers | None = None
        self.parallel: ParallelContext = SINGLE
        # rank 0 of a process group: leaves it, stops the ranks
        self._stop_ranks: weakref.finalize | None = None
        torch.manual_seed(config.seed)
        files = resolve_model(config.model, need_weights=config.load_format != "dummy")
        # A folder `mlaserve convert` wrote: MLA without calibrating.
        saved = saved_conversion(files.config_dict)
        if saved is not None:
            self.config = config = _with_saved_conversion(config, saved)
        self.model_config = ModelConfig.from_hf(
            files.config_dict, config.dtype, self.device, config.max_model_len
        )
        check_engine_options(config, self.model_config)  # what the model's cache cannot take, before any load
        external = config.distributed_executor_backend == "external_launcher"
        if external:
            tp_rank, init_method = _launched_rank(config.tensor_parallel_size), "env://"
        try:
            if config.distributed:
                self._start_parallel(tp_rank, init_method, external)
            self._build(config, files, saved, tp_rank)
        except BaseException as error:
            dead = self.workers.wait_for_death(2.0) if self.workers is not None else None
            self.close()
            if dead is not None:  # the rank's own traceback is in the log above
                raise WorkerDied(f"start-up failed: {dead}") from error
            raise
        if external and tp_rank:
            # A launched rank past 0 serves rank 0's steps inside LLM(...) and ends when rank 0's engine closes: the
            # rest of the script is rank 0's.
            from mlaserve.parallel.group import exit_rank

            self.serve_plans()
            exit_rank()

    def _start_parallel(self, tp_rank: int, init_method: str | None, external: bool) -> None:
        """Rank 0 starts the other ranks (unless a launcher did); every rank joins the group on its own device."""
        import os

        from mlaserve.parallel.group import free_init_method, init_parallel, rank_device, share_cpu_cores

        size = self.config.tensor_parallel_size
        local_rank = int(os.environ.get("LOCAL_RANK", tp_rank)) if external else tp_rank
        gpus = torch.cuda.device_count() if self.device.type == "cuda" else 0
        if self.device.type == "cuda" and not external and size > gpus:
            raise ValueError(f"tensor_parallel_size={size} needs {size} GPUs; this process sees {gpus}")
        if self.device.type == "cuda" and local_rank >= gpus:
            raise ValueError(
                f"tensor_parallel_size={size} needs a GPU per rank; rank {tp_rank} is local rank {local_rank} and "
                f"this process sees {torch.cuda.device_count()} GPU(s)"
            )
        if tp_rank == 0 and not external:
            init_method = free_init_method()
            self.workers = Workers(self.config, init_method)
        self.device = rank_device(self.device, local_rank)
        if self.device.type == "cpu":  # the ranks of one machine share its cores (torchrun says how many)
            share_cpu_cores(int(os.environ.get("LOCAL_WORLD_SIZE", size)) if external else size)
        self.parallel = init_parallel(
            tp_rank, size, init_method, self.device, self.config.enable_expert_parallel
        )
        if tp_rank == 0:
            # when the engine goes, or at exit, whichever comes first (without holding the engine alive)
            self._stop_ranks = weakref.finalize(self, stop_ranks, self.workers, self.parallel)
        logger.info(
            "tensor parallel: rank %d of %d on %s%s", tp_rank, size, self.device,
            ", experts split across ranks" if self.config.enable_expert_parallel else "",
        )  # fmt: skip

    def _build(self, config: EngineConfig, files: object, saved: dict | None, tp_rank: int) -> None:
        # skip_tokenizer_init (as vLLM): token ids in, token ids out; for speed runs on configs with no tokenizer.
        self.tokenizer = (
            None
            if config.skip_tokenizer_init or tp_rank
            else load_tokenizer(files, self.model_config.hf_config)
        )
        self.backend = select_backend(self.device, config.attention_backend)
        self.model, self.load_report = build_model(
            self.model_config,
            files,
            self.backend,
            self.device,
            config.load_format,
            config.seed,
            config.mla_disable,
            config.enable_mla,
            config.mla_skip_layers,
            self.parallel,
        )
        if saved is not None:
            apply_saved_conversion(self.model, files.path)
            logger.info(
                "MLA conversion read from %s: kv_lora_rank per layer %s, KV bytes per token %s",
                files.path,
                saved["ranks"],
                saved["kv_bytes_per_token"],
            )
        elif config.mla_latent_dim or config.qk_rope_head_dim:
            self._convert_to_low_rank_mla()
        max_len = self.model_config.max_model_len
        # With chunked prefill the budget is vLLM's for large GPUs, whatever max_model_len: tying it to a short
        # max_model_len (2,048) ran a burst of 256 prompts through 65 mixed steps instead of 17, at half the
        # offline tokens/s (27-layer V2-Lite shape on an H200, diagnose burst section against serve_vs_offline).
        batched = config.max_num_batched_tokens or (
            max(8192, max_len) if not config.enable_chunked_prefill else 8192
        )
        self._init_kv_cache(batched)
        self.scheduler = Scheduler(
            SchedulerConfig(
                config.max_num_seqs, batched, max_len, config.enable_chunked_prefill, config.prefill_first
            ),
            self.kv_manager,
        )
        self.runner = ModelRunner(
            self.model,
            self.kv_caches,
            config.block_size,
            self.device,
            self.group_rules,
            self.parallel,
        )
        if self.device.type == "cuda":
            self.runner.warm_up(batched, max_len)
        # The backends' captured decode reads one block table: models whose layers go through them with windowed
        # layers (several cache groups) run eagerly. A model that attends on its own says for itself.
        one_group = self.kv_spec.group_rules() == [FULL]
        graphable = self.model.supports_cuda_graphs and (
            self.model.attends_itself
            or (self.backend.supports_cuda_graphs and self.kv_spec.is_mla and one_group)
        )
        if self.device.type == "cuda" and not config.enforce_eager and graphable:
            # Fresh-prefill graphs need the varlen flash attention, which takes 16-bit inputs only.
            half = (
                self.model_config.dtype in (torch.float16, torch.bfloat16)
                and self.model.supports_prefill_graphs
            )
            self.runner.enable_cuda_graphs(max_len, config.max_num_seqs, min(2048, batched) if half else 0)
        self._prompt_logprobs: dict[str, list[dict[int, float] | None]] = {}
        self._grammar_compiler: GrammarCompiler | None = None
        self.intake = RequestIntake(self.tokenizer, self.model_config, self.grammar_compiler)
        self._ids = itertools.count()
        self.num_generated_tokens = 0
        # Off on CPU by default: there the host and the "device" are the same cores, so nothing overlaps.
        auto = self.device.type == "cuda"
        self.async_scheduling = auto if config.async_scheduling is None else config.async_scheduling
        self._in_flight: LaunchedStep | None = None  # the lookahead step queued by the last step() call

    def _convert_to_low_rank_mla(self) -> None:
        """enable_mla at reduced rank: the exact latent layers converted from calibration activations."""
        from mlaserve.conversion.mla import calibration_text, convert_model

        if self.tokenizer is None:
            raise ValueError("mla_latent_dim / qk_rope_head_dim calibrate on text: they need the tokenizer")
        ids = self.tokenizer.encode(calibration_text())[: min(2048, self.model_config.max_model_len)]
        if len(ids) < 64:
            raise ValueError(
                f"the calibration text encodes to {len(ids)} tokens with this model's tokenizer: too few to convert"
            )
        cfg = self.config
        report = convert_model(
            self.model,
            cfg.mla_latent_dim,
            cfg.qk_rope_head_dim,
            ids,
            cfg.block_size,
            self.device,
            cfg.mla_rank_allocation,
        )
        logger.info(report)

    def _init_kv_cache(self, max_step_tokens: int) -> None:
        cfg, model_dtype = self.config, self.model_config.dtype
        window, ratio = cfg.sliding_window, cfg.compress_ratio
        if ratio:
            # A query sees exactly back to the start of the group its window begins in: window + ratio - 1 tokens
            # stay in the window group; older ones live on as pooled entries, in a group of their own.
            window += ratio - 1
        self.kv_spec = with_sliding_window(self.model.kv_cache_spec(), window, cfg.num_sink_tokens)
        self.model.set_cache_groups(self.kv_spec.layer_groups())
        self.group_rules = self.kv_spec.group_rules()
        if ratio:
            source = AttentionRule(window, cfg.num_sink_tokens)
            self.group_rules.append(dataclasses.replace(source, ratio=ratio))
            rule = PooledWindow(cfg.sliding_window, ratio, cfg.num_sink_tokens)
            self.model.set_pooled_window(rule, self.group_rules.index(source), len(self.group_rules) - 1)
        if cfg.index_topk:
            self.model.set_block_topk(cfg.index_topk)
        self.cache_dtype = dtype = resolve_cache_dtype(cfg.kv_cache_dtype, model_dtype, self.kv_spec.is_mla)
        num_blocks = num_kv_blocks(cfg, self.kv_spec, dtype, self.device)
        if self.parallel.distributed:  # every rank's cache has the same blocks: the smallest budget decides
            from mlaserve.parallel.group import min_over_ranks

            num_blocks = min_over_ranks(self.parallel, num_blocks)
        capacity = (num_blocks - 1) * cfg.block_size
        groups = [
            # A pooled group's block holds block_size entries, i.e. spans block_size x ratio tokens.
            CacheGroupSpec(i, "full", cfg.block_size * r.ratio)
            if r.ratio
            else CacheGroupSpec(
                i, "full" if r.window is None else "sliding_window", cfg.block_size, r.window, r.sinks
            )
            for i, r in enumerate(self.group_rules)
        ]
        self.kv_manager = KVCacheManager(groups, num_blocks, cfg.enable_prefix_caching, max_step_tokens)
        # One request of max_model_len tokens must fit alone: every group's blocks for it (a window group's stay
        # bounded by its window), from one pool.
        needed = self.kv_manager.max_blocks_per_request(self.model_config.max_model_len)
        if needed > num_blocks - 1:
            raise ValueError(
                f"the KV cache has {num_blocks - 1} blocks of {cfg.block_size} tokens; one request of "
                f"max_model_len={self.model_config.max_model_len} tokens needs {needed}: raise the KV budget "
                "(kv_cache_memory_bytes / gpu_memory_utilization / num_kv_blocks) or lower max_model_len"
            )
        self.kv_caches = allocate_kv_caches(self.kv_spec, num_blocks, cfg.block_size, dtype, self.device)
        self.bytes_per_token = self.kv_spec.context_bytes_per_token(dtype)
        line = (
            f"KV cache: {num_blocks - 1} blocks x {cfg.block_size} tokens = {capacity} tokens, "
            f"{self.bytes_per_token} bytes/token ({dtype})"
        )
        if self.kv_spec.mha_elements_per_layer:
            mha = self.kv_spec.mha_bytes_per_token(model_dtype)
            line += f"; per-head K/V would cost {mha} bytes/token ({mha / self.bytes_per_token:.1f}x)"
        if (
            len(groups) > 1
            or groups[0].window is not None
            or any(self.kv_spec.group_bytes_per_token(dtype, True))
        ):
            line += "; cache groups: " + ", ".join(self._group_descriptions())
        self.attention_kernel = attention_kernel(
            self.backend, self.model, dtype, cfg.block_size, self.device, model_dtype
        )
        logger.info(line + f"; attention {self.backend.name}, decode kernel {self.attention_kernel}")

    def _group_descriptions(self) -> list[str]:
        """Each cache group, e.g. "full: 7 layers, 3584 bytes/token" or "window 64: 21 layers, ..."."""
        groups = self.kv_spec.layer_groups()
        sizes = self.kv_spec.group_bytes_per_token(self.cache_dtype)
        index = self.kv_spec.group_bytes_per_token(self.cache_dtype, index_only=True)
        out = []
        for g, rule in enumerate(self.group_rules):
            if rule.ratio:
                source = self.group_rules.index(dataclasses.replace(rule, ratio=None, span=None))
                out.append(f"pooled 1:{rule.ratio} of group {source}: {sizes[source]} bytes/entry")
                continue
            kind = "full" if rule.window is None else f"window {rule.window}"
            kind += f" + {rule.sinks} sink tokens" if rule.sinks else ""
            text = f"{kind}: {groups.count(g)} layers, {sizes[g]} bytes/token"
            out.append(text + (f" ({index[g]} of them indexer keys)" if index[g] else ""))
        return out

    # ---- requests -------------------------------------------------------------------------------------------
    def prepare(self, prompt: str | dict, params: SamplingParams) -> PreparedRequest:
        """Validate and tokenize without side effects, so a bad request in a batch starts no work."""
        return self.intake.prepare(prompt, params)

    def grammar_compiler(self) -> GrammarCompiler:
        if self._grammar_compiler is None:
            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.model_config.vocab_size)
        return self._grammar_compiler

    def add_core(self, prepared: PreparedRequest, request_id: str | None = None) -> str:
        """Queue a prepared request; returns its id (a fresh one when none is given)."""
        params = prepared.params
        request_id = request_id or str(next(self._ids))
        room = self.model_config.max_model_len - len(prepared.prompt_token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        eos_ids = self.model_config.eos_token_ids
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        eos = tok_eos if tok_eos is not None else (eos_ids[0] if eos_ids else None)
        stop_ids = list(params.stop_token_ids or [])
        if not params.ignore_eos:
            stop_ids += [e for e in eos_ids if e != eos]
        request = Request(
            request_id,
            prepared.prompt_token_ids,
            max_tokens,
            arrival_index=next(self._ids),
            eos_token_id=eos,
            stop_token_ids=tuple(stop_ids),
            ignore_eos=params.ignore_eos,
            sampling_params=params,
            read_prefix_cache=params.prompt_logprobs is None,
            arrival_time=time.monotonic(),
        )
        grammar = None
        if params.structured_outputs is not None:
            grammar = self.grammar_compiler().new(params.structured_outputs)
        self.scheduler.add_request(request)  # first: it rejects a duplicate id before any state is replaced
        if params.seed is not None:
            self.runner.add_generator(request_id, params.seed)
        if grammar is not None:
            self.runner.add_grammar(request_id, grammar)
        if params.prompt_logprobs is not None:
            self._prompt_logprobs[request_id] = [None] * len(prepared.prompt_token_ids)
        return request_id

    def abort_core(
        self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> list[CoreOutput]:
        """Finish these requests from outside (an abort, or a stop string the reader found); unknown ids are
        skipped. Their final outputs carry no new token."""
        finals = []
        for request_id in request_ids:
            request = self.scheduler.finish_request(request_id, status)
            if request is not None:
                finals.append(self._final(request, []))
        return finals

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def release_finished(self) -> None:
        """Free the blocks of the requests the last step finished: call once its outputs are sent (the next step
        does it otherwise)."""
        self.scheduler.release_finished()

    def forget_prefix_cache_after_failure(self) -> None:
        """After a step raised and its requests were failed: a scheduled step offers its blocks to the prefix
        cache before its forward writes them, so a step that did not run to its end may have left hashes over
        garbage. With every request gone, forget them all (kept, with a warning, if any block is still held)."""
        self.scheduler.release_finished()
        if not self.kv_manager.reset_prefix_cache():
            logger.warning("the prefix cache was kept after a failed step: blocks are still in use")

    # ---- the step loop ----------------------------------------------------------------------------------------
    def step_core(self) -> list[CoreOutput]:
        """Schedule, run the model once, apply the sampled tokens: one CoreOutput per request that got a token.

        With asynchronous scheduling the next step is queued on the device before this step's tokens are
        read, so the GPU does not wait for the host's bookkeeping between steps; that step is the one collected by
        the next call."""
        if self.workers is not None:
            self.workers.check()
        launched, self._in_flight = self._in_flight, None
        try:
            if launched is None:
                output = self.scheduler.schedule()
                if output.is_empty:
                    return []
                launched = self.runner.launch(output)
            if self.async_scheduling and not launched.needs_host:
                ahead = self.scheduler.schedule_lookahead(launched.output)
                if ahead is not None:
                    self._in_flight = self.runner.launch(ahead, previous=launched)
            result = self.runner.collect(launched)
            trace("core_collected")
            outputs = self._apply(launched.output, result)
        except BaseException as error:
            self._in_flight = None  # its rows are scheduled again from the requests' state
            # a collective that failed: did a rank go?
            dead = (
                self.workers.wait_for_death(1.0 if isinstance(error, RuntimeError) else 0.0)
                if self.workers
                else None
            )
            if dead is not None:
                raise WorkerDied(dead) from error
            raise
        ahead = self._in_flight
        if ahead is not None and all(s.request.is_finished for s in ahead.output.scheduled):
            self._in_flight = None  # every row stopped in this step: nothing to collect
        return outputs

    def _apply(self, output: SchedulerOutput, result: StepResult) -> list[CoreOutput]:
        self.num_generated_tokens += len(result.token_ids)
        for rid, (first, entries) in result.prompt_logprobs.items():
            slots = self._prompt_logprobs.get(rid)
            if slots is not None:  # positions recomputed after a preemption overwrite equal values
                slots[first : first + len(entries)] = entries
        finished = self.scheduler.update_from_output(output, result.token_ids)
        finished_ids = {r.request_id for r in finished}
        outputs = []
        for s in output.scheduled:
            request = s.request
            rid = request.request_id
            # A request finished before this step was collected (aborted, or stopped by the step before a
            # lookahead step) has nothing more to report.
            if rid not in result.token_ids or (request.is_finished and rid not in finished_ids):
                continue
            new = [request.output_token_ids[-1]]
            logprobs = [result.logprobs[rid]] if rid in result.logprobs else None
            if request.first_token_time is None:
                request.first_token_time = time.monotonic()
                prompt_logprobs = self._prompt_logprobs.pop(rid, None)  # complete once the prompt is computed
            else:
                prompt_logprobs = None
            if rid in finished_ids:
                outputs.append(self._final(request, new, logprobs, prompt_logprobs))
            else:
                outputs.append(CoreOutput(rid, new, logprobs, prompt_logprobs=prompt_logprobs))
        return outputs

    def _final(
        self,
        request: Request,
        new: list[int],
        logprobs: list[dict[int, float]] | None = None,
        prompt_logprobs: list | None = None,
    ) -> CoreOutput:
        """The last output of a finished request; its per-request state goes."""
        rid = request.request_id
        self.runner.drop_request(rid)
        self._prompt_logprobs.pop(rid, None)
        out_ids = request.output_token_ids
        stop_reason = None
        if (
            request.status == RequestStatus.FINISHED_STOPPED
            and out_ids
            and out_ids[-1] != request.eos_token_id
        ):
            stop_reason = out_ids[-1]  # a stop token id (a stop string is the reader's to name)
        metrics = {  # vLLM's RequestOutput.metrics, as time.monotonic() stamps
            "arrival_time": request.arrival_time,
            "first_scheduled_time": request.first_scheduled_time,
            "first_token_time": request.first_token_time,
            "finished_time": time.monotonic(),
        }
        return CoreOutput(
            rid,
            new,
            logprobs,
            request.status.finish_reason,
            stop_reason,
            prompt_logprobs,
            max(request.num_cached_tokens, 0),
            metrics,
        )

    # ---- tensor parallelism ----------------------------------------------------------------------------------
    def serve_plans(self) -> None:
        """A rank past 0: run each step rank 0 sends, until it sends the stop (None)."""
        from mlaserve.parallel.group import broadcast_object, leave

        while (plan := broadcast_object(self.parallel)) is not None:
            self.runner.run_plan(plan)
        leave(self.parallel)

    def close(self) -> None:
        """Rank 0 of a tensor-parallel engine: stop the other ranks and leave the process group; idempotent (also
        run when the engine is collected, or at exit)."""
        if self._stop_ranks is not None:
            self._stop_ranks()
        elif self.workers is not None:  # the process group never formed
            self.workers.stop(timeout=0)

    # ---- introspection ---------------------------------------------------------------------------------------
    def capture_mla_graph(self, max_seq_len: int | None = None) -> int:
        """The MLA guides' call: (re)capture the decode CUDA graphs for sequences up to max_seq_len tokens (default
        max_model_len); their attention splits are sized for that length, so shorter limits run short contexts
        faster and longer sequences run eagerly. Returns how many batch sizes were captured."""
        limit = self.model_config.max_model_len
        max_seq_len = limit if max_seq_len is None else max_seq_len
        if not 0 < max_seq_len <= limit:
            raise ValueError(f"max_seq_len must be in 1..max_model_len ({limit}), got {max_seq_len}")
        if self.device.type != "cuda":
            raise RuntimeError(
                f"capture_mla_graph: CUDA graphs need a GPU; this engine runs on {self.device}"
            )
        if self.parallel.distributed:
            raise RuntimeError(
                "capture_mla_graph: not with tensor parallelism (every rank would capture again)"
            )
        if self.runner.graphs is None:
            raise RuntimeError(
                "capture_mla_graph: this engine runs its decode steps eagerly (enforce_eager, or a model or "
                "attention backend that cannot be captured; the start-up log says which)"
            )
        self.runner.enable_cuda_graphs(max_seq_len, self.config.max_num_seqs)
        return len(self.runner.graphs.sizes)

    def stats(self) -> dict:
        self.release_finished()  # the block counts are the pool's
        cache = self.kv_manager.prefix_cache_stats()
        dtype = self.model_config.dtype
        stats = {
            "kv_blocks_total": self.kv_manager.num_total_blocks,
            "kv_blocks_used": self.kv_manager.num_used_blocks,
            "kv_blocks_by_group": self.kv_manager.blocks_per_group(),
            "kv_cache_groups": self._group_descriptions(),
            "kv_bytes_per_token": self.bytes_per_token,
            "kv_capacity_tokens": self.kv_manager.num_total_blocks * self.config.block_size,
            "block_size": self.config.block_size,
            "enable_prefix_caching": self.config.enable_prefix_caching,
            "attention_backend": self.backend.name,
            "attention_kernel": self.attention_kernel,
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_queries": cache["queries"],
            "prefix_cache_hits": cache["hits"],
            "prefix_cache_hit_rate": cache["hits"] / cache["queries"] if cache["queries"] else 0.0,
            "num_generated_tokens": self.num_generated_tokens,
            "dtype": str(dtype).removeprefix("torch."),
            "kv_cache_dtype": str(self.cache_dtype).removeprefix("torch."),
            "device": str(self.device),
            "tensor_parallel_size": self.config.tensor_parallel_size,
        }
        if self.kv_spec.mha_elements_per_layer:
            stats["mha_kv_bytes_per_token"] = self.kv_spec.mha_bytes_per_token(dtype)
        return stats
