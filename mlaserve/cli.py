"""Command line: `mlaserve generate` (prompts in, text out), `mlaserve chat` (interactive, streamed),
`mlaserve serve` (the OpenAI server) and `mlaserve export-tokenizer` (the served model's tokenizer as a folder)."""

import argparse
import json
import logging
import sys

from mlaserve.sampling_params import SamplingParams


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help="HF model folder or .gguf file (default: SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument(
        "--kv-cache-memory-bytes", type=int, default=None, help="KV cache budget (CPU default 1 GiB)"
    )
    parser.add_argument(
        "--attention-backend", default=None, help="torch or sdpa (default: chosen for the hardware)"
    )
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine start-up details")


def engine_options(args: argparse.Namespace) -> dict:
    options = dict(dtype=args.dtype, device=args.device, attention_backend=args.attention_backend)
    if args.max_model_len is not None:
        options["max_model_len"] = args.max_model_len
    if args.kv_cache_memory_bytes is not None:
        options["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes
    return options


def sampling(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.seed,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from mlaserve.llm import LLM

    prompts = list(args.prompts)
    if args.prompt_file:
        with open(args.prompt_file, encoding="utf-8") as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts and not sys.stdin.isatty():
        prompts = [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        print(
            "mlaserve generate: no prompts (give them as arguments, --prompt-file or on stdin)",
            file=sys.stderr,
        )
        return 2
    llm = LLM(args.model, **engine_options(args))
    params = sampling(args)
    inputs = (
        [llm.apply_chat_template([{"role": "user", "content": p}]) for p in prompts] if args.chat else prompts
    )
    outputs = llm.generate(inputs, params, use_tqdm=args.verbose)
    for number, (prompt, out) in enumerate(zip(prompts, outputs), 1):
        completion = out.outputs[0]
        if args.json:
            record = {"prompt": prompt, "text": completion.text, "finish_reason": completion.finish_reason}
            print(json.dumps(record, ensure_ascii=False))
            continue
        # Headed blocks: a completion may span lines, and the prompt says which answer is which.
        if number > 1:
            print()
        print(f"### prompt {number}\n{prompt}")
        tokens = len(completion.token_ids)
        print(
            f"### completion {number} ({tokens} tokens, finish: {completion.finish_reason})\n{completion.text}"
        )
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from mlaserve.llm import LLM

    llm = LLM(args.model, **engine_options(args))
    engine, params = llm.engine, sampling(args)
    messages: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    print("mlaserve chat: type a message, an empty line or Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            user = input("> ")
        except EOFError:
            break
        if not user.strip():
            break
        messages.append({"role": "user", "content": user})
        rid = engine.add_request(llm.apply_chat_template(messages), params)
        shown, final = 0, None
        while final is None:
            for out in engine.step():
                if out.request_id != rid:
                    continue
                text = out.outputs[0].text
                # A partial UTF-8 character decodes as U+FFFD until its last byte arrives; print only settled text.
                settled = len(text) if out.finished else len(text.rstrip("\ufffd"))
                if settled > shown:
                    print(text[shown:settled], end="", flush=True)
                    shown = settled
                if out.finished:
                    final = text
        print()
        messages.append({"role": "assistant", "content": final})
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from mlaserve.config.deploy import load_deploy_config
    from mlaserve.config.deploy_overrides import overrides_from_flags
    from mlaserve.server.run import serve

    # One validation path with or without a file: flags are overrides of the (possibly empty) deploy config.
    deploy = load_deploy_config(args.config, overrides_from_flags(vars(args)))
    options = deploy.engine_options()
    if args.num_kv_blocks is not None:
        options["num_kv_blocks"] = args.num_kv_blocks
    return serve(options, deploy.server_settings())


def cmd_convert(args: argparse.Namespace) -> int:
    """A Llama/Qwen2/Mistral folder converted to MLA once (conversion/folder.py), for `LLM(DST)` and serve."""
    from mlaserve.convert import convert_folder

    ranks = args.mla_latent_dim
    options = {
        "mla_latent_dim": ranks[0] if ranks is not None and len(ranks) == 1 else ranks,
        "qk_rope_head_dim": args.qk_rope_head_dim,
        "mla_skip_layers": args.mla_skip_layers,
        "mla_rank_allocation": args.mla_rank_allocation,
        "dtype": args.dtype,
        "device": args.device,
    }
    options = {k: v for k, v in options.items() if v is not None}
    section = convert_folder(args.src, args.dst, args.format, **options)
    kv, skipped = section["kv_bytes_per_token"], section["mla_skip_layers"]
    print(
        f"converted {args.src} -> {args.dst}: kv_lora_rank per layer {section['ranks']}"
        + (f" (layers {skipped} keep per-head K/V)" if skipped else "")
        + f"; KV bytes per token {kv['before']} -> {kv['after']} ({section['cache_dtype']}); "
        f"calibration: {section['calibration'] or 'none (exact conversion)'}; format {section['format']}"
    )
    return 0


def cmd_export_tokenizer(args: argparse.Namespace) -> int:
    """The served model's tokenizer (and chat template) as a Hugging Face tokenizer folder, for tools that take a
    tokenizer path (lm-eval's --model_args tokenizer=..., guidellm's --processor)."""
    from mlaserve.loader.model_files import resolve_model
    from mlaserve.loader.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model(args.model, need_weights=False))
    files = tokenizer.save_pretrained(args.output)
    print(f"wrote the tokenizer of {args.model or 'the default model'} to {args.output}: {len(files)} files")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mlaserve", description="An MLA-first LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for prompts")
    gen.add_argument("prompts", nargs="*", help="prompts (or use --prompt-file / stdin)")
    gen.add_argument("--prompt-file", default=None, help="one prompt per line")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    add_engine_args(gen)
    chat = sub.add_parser("chat", help="interactive chat with streamed tokens")
    chat.add_argument("--system", default=None, help="system message")
    add_engine_args(chat)
    from mlaserve.server.cli_args import add_serve_args, int_list

    add_serve_args(sub.add_parser("serve", help="OpenAI-compatible HTTP server"))
    convert = sub.add_parser("convert", help="convert a Llama/Qwen2/Mistral folder to MLA (enable_mla) once")
    convert.add_argument("src", help="Hugging Face model folder")
    convert.add_argument(
        "dst", help="new folder to write; LLM(DST) and `serve --model DST` serve it as converted"
    )
    convert.add_argument(
        "--mla-latent-dim",
        type=int_list,
        default=None,
        help="latent rank, or one per converted layer: 64,48,...",
    )
    convert.add_argument(
        "--qk-rope-head-dim", type=int, default=None, help="rotary features kept per KV head"
    )
    convert.add_argument(
        "--mla-skip-layers", type=int_list, default=None, help="layers that keep per-head K/V, e.g. 0,27"
    )
    convert.add_argument("--mla-rank-allocation", default=None, help="uniform (default) or error")
    convert.add_argument("--dtype", default="float32", help="dtype the calibration runs in (default float32)")
    convert.add_argument("--device", default="cpu")
    convert.add_argument(
        "--format",
        default="auto",
        choices=("auto", "deepseek_v2", "mlaserve"),
        help="deepseek_v2: a DeepSeek-V2 folder transformers loads too (one rank, no skipped layer); mlaserve: any "
        "conversion, served by mlaserve; auto (default): deepseek_v2 where it can",
    )
    export = sub.add_parser("export-tokenizer", help="write the model's tokenizer as a Hugging Face folder")
    export.add_argument("output", help="folder to write (created if missing)")
    export.add_argument(
        "--model", default=None, help="HF model folder or .gguf file (default: SmolLM2-135M-Instruct)"
    )
    args = parser.parse_args(argv)
    verbose = args.command == "serve" or getattr(args, "verbose", False)  # a server logs its start-up report
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(message)s"
    )
    commands = {
        "generate": cmd_generate,
        "chat": cmd_chat,
        "serve": cmd_serve,
        "convert": cmd_convert,
        "export-tokenizer": cmd_export_tokenizer,
    }
    try:
        return commands[args.command](args)
    except (ValueError, TypeError, OSError) as e:
        print(f"mlaserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
