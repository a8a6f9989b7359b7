"""The ``vgraph`` command line.

Sub-commands import their heavy modules lazily, so ``vgraph --help`` is instant and a bad
flag fails before torch loads. User errors print one line and exit 2, never a traceback.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Callable, Optional, Sequence


class UserError(Exception):
    """A problem with what the user asked for; printed without a traceback."""


def _cmd_ops(args: argparse.Namespace) -> int:
    if args.action == "list":
        import torch

        from vgraph.ops.registration import defined_ops
        for name in defined_ops():
            print(getattr(torch.ops.vgraph, name).default._schema)
        return 0
    return _ops_check(args.device)


def _ops_check(device: str) -> int:
    import torch
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for but CUDA is not available")
    if device == "cpu":
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            raise UserError("Triton was imported before TRITON_INTERPRET=1 could be set")
        os.environ["TRITON_INTERPRET"] = "1"  # kernels run interpreted on CPU tensors
    from vgraph.ops.selfcheck import run_checks

    results = run_checks(device)
    mode = "compiled" if device == "cuda" else "interpreted"
    print(f"Triton kernels ({mode}, {device}) vs plain-torch references:")
    print(f"{'op':40s} {'dtype':9s} {'max rel err':>12s} {'tolerance':>10s}  result")
    for r in results:
        dtype = str(r.dtype).replace("torch.", "")
        print(f"{r.op:40s} {dtype:9s} {r.max_rel_error:12.3g} {r.tolerance:10.3g}  {'ok' if r.ok else 'FAIL'}")
    failed = [r for r in results if not r.ok]
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by every command that builds an engine (named as in vLLM)."""
    p.add_argument("--model", default=None, help="local HF model directory or hub id (default: the demo model)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="KV cache size on CPU")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quantization", default=None, choices=["fp8"])
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: build the model from config.json with random weights, reading no "
                        "weight files (for benchmarks)")
    p.add_argument("--enforce-eager", action="store_true", help="no compilation (and no CUDA graphs)")
    p.add_argument("--compile-sizes", type=int, nargs="*", default=[],
                   help="token counts compiled statically besides the dynamic shape")
    p.add_argument("--custom-ops", action=argparse.BooleanOptionalAction, default=None,
                   help="norms and activations as vgraph ops (--custom-ops) or in plain torch, so "
                        "Inductor generates their kernels (--no-custom-ops). Default: plain torch "
                        "for a compiled, unquantized model on CPU, the ops otherwise")
    p.add_argument("--no-fusion", dest="enable_fusion", action="store_false",
                   help="skip vgraph's fusion passes")
    p.add_argument("--cudagraph-mode", default=None,
                   choices=["none", "piecewise", "full", "full_and_piecewise"],
                   help="CUDA graphs: FULL for decode batches, PIECEWISE for mixed ones "
                        "(default: full_and_piecewise; --enforce-eager turns graphs off too)")
    p.add_argument("--cudagraph-capture-sizes", type=int, nargs="+", default=None,
                   help="batch sizes / token counts to capture (default: 1 2 4 8 16 ... 256)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--sampling-seed", type=int, default=None)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--n", type=int, default=1)


def _model_path(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    from vgraph.models.demo import ensure_demo_model
    from vgraph.paths import cache_dir
    logging.getLogger("vgraph").warning("no --model given: using the built-in demo model (untrained weights)")
    return str(ensure_demo_model(cache_dir()))


def _llm_from_args(args: argparse.Namespace):
    from vgraph import LLM
    from vgraph.config import CompileConfig
    compile_config = CompileConfig(level="none" if args.enforce_eager else "compiled",
                                   compile_sizes=list(args.compile_sizes), custom_ops=args.custom_ops,
                                   enable_fusion=args.enable_fusion, cudagraph_mode=args.cudagraph_mode,
                                   cudagraph_capture_sizes=args.cudagraph_capture_sizes)
    return LLM(_model_path(args), dtype=args.dtype, max_model_len=args.max_model_len,
               max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
               block_size=args.block_size, enable_prefix_caching=args.enable_prefix_caching,
               gpu_memory_utilization=args.gpu_memory_utilization, cpu_kv_cache_gib=args.kv_cache_gib,
               device=args.device, seed=args.seed, quantization=args.quantization,
               compile_config=compile_config, load_format=args.load_format)


def _cmd_compile(args: argparse.Namespace) -> int:
    """Compiles what `serve`/`generate` will need and stores it in the compile cache."""
    import time
    if args.enforce_eager:
        raise UserError("--enforce-eager turns compilation off; nothing to compile")
    start = time.perf_counter()
    engine = _llm_from_args(args).engine
    c, cache = engine.compile_counters, engine.compile_cache
    print(f"model:          {engine.config.model.model}")
    print(f"pieces:         {c.pieces} ({c.compiled_pieces} compiled, {c.unique_piece_graphs} distinct graphs)")
    print(f"inductor:       {c.inductor_compilations} compilations in {c.inductor_seconds:.2f} s")
    print(f"cache loads:    {c.cache_loads} in {c.cache_load_seconds:.2f} s; saves: {c.cache_saves}")
    print(f"captured graph: {_captured_status(c.captured_graph)}")
    print(f"pass matches:   " + (", ".join(f"{k}={v}" for k, v in c.pass_matches.items()) or "none"))
    print(f"cache folder:   {cache.folder}")
    print(f"total:          {time.perf_counter() - start:.2f} s")
    return 0


def _captured_status(state: str) -> str:
    return {"saved": "saved (warm starts skip Dynamo)", "loaded": "loaded from the cache (Dynamo skipped)"}.get(
        state, "not recorded (warm starts trace with Dynamo)")


def _cmd_cache(args: argparse.Namespace) -> int:
    from vgraph.compiler.cache import clear_entries, list_entries
    from vgraph.paths import cache_dir
    root = cache_dir()
    if args.action == "clear":
        print(f"removed {clear_entries(root)} compile cache entries from {root / 'compile'}")
        return 0
    entries = list_entries(root)
    print(f"compile cache: {root / 'compile'} ({len(entries)} entries)")
    for e in entries:
        print(f"  {e['name']}  {e['artifacts']} artifacts  {e['bytes'] / 2**20:.1f} MiB")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from vgraph import SamplingParams
    params = SamplingParams(
        n=args.n, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, seed=args.sampling_seed, stop=args.stop,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, ignore_eos=args.ignore_eos)
    llm = _llm_from_args(args)
    for out in llm.generate(args.prompt, params, use_tqdm=len(args.prompt) > 1):
        for completion in out.outputs:
            print(f"--- prompt {out.prompt!r} [{completion.finish_reason}, {len(completion.token_ids)} tokens]")
            print(completion.text)
    return 0


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    """The server's own flags (named as in vLLM); the engine's come from ``_add_engine_args``."""
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model to serve (same as --model; default: the demo model)")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default: all interfaces)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use in 'model' (default: the model as given, or demo-model-v1)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $VGRAPH_API_KEY)")
    p.add_argument("--max-logprobs", type=int, default=20, help="largest logprobs/top_logprobs a request may ask")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template, or a file holding one (default: the tokenizer's)")
    p.add_argument("--max-queue-len", type=int, default=1024,
                   help="requests waiting to be scheduled before new ones get 503 + Retry-After")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may take to finish after SIGTERM")
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")


def _chat_template(value: Optional[str]) -> Optional[str]:
    """``--chat-template``: a path to a template file, or the template itself."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise UserError(f"--chat-template {value!r} is neither a file nor a Jinja template")


def _cmd_serve(args: argparse.Namespace) -> int:
    """Serves the OpenAI-compatible API until SIGTERM (exit 0) or a fatal engine error (exit 1)."""
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise UserError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    for flag, value, low in (("--port", args.port, 0), ("--max-queue-len", args.max_queue_len, 1),
                             ("--max-logprobs", args.max_logprobs, 0), ("--shutdown-timeout", args.shutdown_timeout, 0)):
        if value < low:
            raise UserError(f"{flag} must be at least {low}, got {value}")
    if args.port > 65535:
        raise UserError(f"--port must be at most 65535, got {args.port}")
    # The engine thread shares the CPU with the HTTP thread. OpenMP workers that spin between
    # parallel regions (the default) starve it, and on a busy machine every region then waits
    # for descheduled spinners: measured on 2 cores, inter-token latency at 1 stream went from
    # ~150 ms to ~10 ms with passive waiting. Read by OpenMP when torch loads, so set it first;
    # an explicit OMP_WAIT_POLICY from the user wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from vgraph.models.demo import DEMO_MODEL_NAME
    from vgraph.server.lifecycle import serve
    from vgraph.server.state import ServerSettings
    default_name = args.model if args.model else DEMO_MODEL_NAME
    settings = ServerSettings(served_model_names=args.served_model_name or [default_name],
                              api_key=args.api_key or os.environ.get("VGRAPH_API_KEY") or None,
                              chat_template=_chat_template(args.chat_template), max_queue_len=args.max_queue_len)

    def build_engine():
        """Runs on the engine thread, so /health answers 503 while this loads and compiles."""
        engine = _llm_from_args(args).engine
        engine.config.max_logprobs = args.max_logprobs  # read by add_request's validation
        return engine

    return serve(settings, build_engine, host=args.host, port=args.port, shutdown_timeout=args.shutdown_timeout,
                 log_level=args.log_level, access_log=args.access_log)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vgraph", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True)
    ops = sub.add_parser("ops", help="list the custom ops or check every Triton kernel against its reference")
    ops.add_argument("action", choices=["list", "check"])
    ops.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ops.set_defaults(handler=_cmd_ops)
    gen = sub.add_parser("generate", help="generate completions for prompts offline")
    gen.add_argument("--prompt", action="append", required=True, help="a prompt (repeatable)")
    _add_engine_args(gen)
    _add_sampling_args(gen)
    gen.set_defaults(handler=_cmd_generate)
    comp = sub.add_parser("compile", help="fill the compile cache ahead of time so later starts are warm")
    _add_engine_args(comp)
    comp.set_defaults(handler=_cmd_compile)
    cache = sub.add_parser("cache", help="list or clear compile cache entries ($VGRAPH_CACHE_DIR)")
    cache.add_argument("action", choices=["list", "clear"])
    cache.set_defaults(handler=_cmd_cache)
    srv = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API (default model: the demo model)")
    _add_serve_args(srv)
    _add_engine_args(srv)
    srv.set_defaults(handler=_cmd_serve)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if not _is_user_error(exc):
            raise
        print(f"vgraph {args.command}: error: {exc}", file=sys.stderr)
        return 2


def _is_user_error(exc: Exception) -> bool:
    """Errors caused by what the user asked for (bad flags, values, paths, model ids)."""
    kinds: tuple = (UserError, ValueError, FileNotFoundError)
    loader = sys.modules.get("vgraph.models.loader")  # not imported for every command
    if loader is not None:
        kinds += (loader.ModelLoadError,)
    return isinstance(exc, kinds)


if __name__ == "__main__":
    sys.exit(main())
