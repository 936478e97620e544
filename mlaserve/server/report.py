"""The start-up report: what an operator checks first (weights, layout, backend, KV capacity, address).

Logged at start and served under `mlaserve` on /v1/models, so a deployment can be verified over HTTP. The engine
logs its backend, weights and KV cache as it builds them (what an offline run shows); `serve()` keeps those lines
quiet and this report says each once, in the order below.
"""

from __future__ import annotations

from mlaserve.config.server_settings import ServerSettings
from mlaserve.engine.core import EngineCore
from mlaserve.executor.build_info import BuildInfo


def describe_core(core: EngineCore, settings: ServerSettings) -> dict:
    """The report, computed in the core's process (where the engine is) and sent to the server's."""
    return startup_report(core.build_info, core.stats(), settings)


def startup_report(built: BuildInfo, stats: dict, settings: ServerSettings) -> dict:
    """What the engine built (and why, as it logged it) and its stats, in the operator's order."""
    load = built.load
    kv = {
        "blocks": stats["kv_blocks_total"],
        "block_size": stats["block_size"],
        "capacity_tokens": stats["kv_capacity_tokens"],
        "bytes_per_token": stats["kv_bytes_per_token"],
        "dtype": stats.get("kv_cache_dtype", stats["dtype"]),
        "groups": stats.get("kv_cache_groups", []),
    }
    if "kv_pool_blocks" in stats:  # a pool per cache group (DeepSeek-V4)
        kv["pool_blocks"] = stats["kv_pool_blocks"]
    if "mha_kv_bytes_per_token" in stats:  # MLA: what per-head K/V would have cost
        mha = stats["mha_kv_bytes_per_token"]
        kv["mha_bytes_per_token"] = mha
        kv["saving_ratio"] = round(mha / stats["kv_bytes_per_token"], 2)
    report = {
        "model": built.model or "default (SmolLM2-135M-Instruct)",
        "architecture": built.architecture,
        "served_model_name": settings.served_model_name,
        "weights": {
            "num_tensors": load.num_tensors,
            "num_parameters": load.num_parameters,
            "ignored": load.ignored,
            "missing": list(load.missing[:10]),
            "unexpected": list(load.unexpected[:10]),
            "shape_mismatches": list(load.shape_mismatches[:10]),
            "bytes": load.weight_bytes,
            "bytes_by_kind": dict(load.bytes_by_kind),
            "quantization": stats.get("quantization"),
        },
        "parallel": {
            "tensor_parallel_size": built.tensor_parallel_size,
            "pipeline_parallel_size": 1,
            "expert_parallel": built.expert_parallel,
            "distributed": built.distributed,
            # ranks past 0, when the engine started them (not under torchrun)
            "rank_pids": list(built.rank_pids),
        },
        "attention_backend": built.attention_backend,
        "attention_backend_reason": built.attention_backend_reason,
        "attention_kernel": built.attention_kernel,
        "prefill_kernel": built.prefill_kernel,
        "device": built.device,
        "max_model_len": built.max_model_len,
        "kv_cache": kv,
        "address": f"http://{settings.host}:{settings.port}",
    }
    if settings.metrics_port is not None:
        report["ops_address"] = f"http://{settings.host}:{settings.metrics_port}"
    return report


def kv_line(kv: dict) -> str:
    """Capacity and bytes per token. With a pool per group the capacity is what the compressed-entry pools hold
    (a block of a 1:r group spans block_size x r tokens), not the blocks of all pools times block_size."""
    tail = f"{kv['capacity_tokens']} tokens, {kv['bytes_per_token']} bytes/token ({kv['dtype']})"
    if "pool_blocks" in kv:
        pools = ", ".join(str(n) for n in kv["pool_blocks"])
        return f"KV cache: pools of {pools} blocks x {kv['block_size']} slots (one per group) = {tail}"
    return f"KV cache: {kv['blocks']} blocks x {kv['block_size']} tokens = {tail}"


def format_report(report: dict) -> list[str]:
    """Log lines, one per concern, in the order an operator reads them."""
    w, kv, par = report["weights"], report["kv_cache"], report["parallel"]

    def names(items: list[str]) -> str:
        return ", ".join(items) if items else "none"

    lines = [
        f"model {report['architecture']} from {report['model']} served as '{report['served_model_name']}' on "
        f"{report['device']}, max_model_len {report['max_model_len']}",
        f"weights: {w['num_tensors']} tensors ({w['num_parameters'] / 1e6:.1f}M parameters) loaded, "
        f"{w['ignored']} ignored; "
        f"missing: {names(w['missing'])}; unexpected: {names(w['unexpected'])}; "
        f"shape mismatches: {names(w['shape_mismatches'])}; "
        + f"{w.get('bytes', 0) / 2**20:.1f} MiB on this rank ("
        + ", ".join(f"{kind} {n / 2**20:.1f} MiB" for kind, n in w.get("bytes_by_kind", {}).items())
        + ")"
        + (f", quantization {w['quantization']}" if w.get("quantization") else ""),
        f"parallel layout: tensor parallel {par['tensor_parallel_size']}"
        + (", experts split across ranks" if par.get("expert_parallel") else "")
        + f", pipeline parallel {par['pipeline_parallel_size']}"
        + (
            f"; one process per rank, ranks 1+ pid {', '.join(map(str, par['rank_pids']))}, each rank's KV cache "
            "as below"
            if par.get("rank_pids")
            else ""
        ),
        f"attention backend: {report['attention_backend']} ({report['attention_backend_reason']}); "
        f"decode kernel: {report['attention_kernel']}; prefill kernel: {report.get('prefill_kernel') or 'n/a'}",
        kv_line(kv),
    ]
    if len(kv["groups"]) > 1 or any(g.startswith("window") or "indexer" in g for g in kv["groups"]):
        pools = "a pool each" if "pool_blocks" in kv else "one pool"
        lines.append(f"KV cache groups ({pools}): " + "; ".join(kv["groups"]))
    if "mha_bytes_per_token" in kv:
        lines.append(
            f"MLA latent cache: per-head K/V would take {kv['mha_bytes_per_token']} bytes/token; "
            f"the latent takes {kv['bytes_per_token']} ({kv['saving_ratio']}x smaller)"
        )
    if "processes" in report:
        procs = report["processes"]
        servers = procs["api_servers"]
        lines.append(
            f"processes: engine core pid {procs['engine_core']}; {len(servers)} API server(s), pid "
            + ", ".join(str(p) for p in servers)
        )
    lines.append(f"listening on {report['address']}")
    if "ops_address" in report:
        lines.append(f"/health and /metrics also on {report['ops_address']}")
    return lines
