"""The ``vgraph`` command line.

Sub-commands import their heavy modules lazily, so ``vgraph --help`` is instant and a bad
flag fails before torch loads. User errors print one line and exit 2, never a traceback.
Engine and server options are made from the fields of their dataclasses (``cli_options``).
"""
from __future__ import annotations

import argparse
import errno
import logging
import os
import re
import socket
import sys
from typing import Any, Callable, Optional, Sequence

from . import __version__, logging_setup, vllm_compat
from .cli_options import add_field_options

DESCRIPTION = (
    "vgraph runs Hugging Face decoder models (Llama, Mistral, Qwen2, Qwen3) through torch.compile "
    "and CUDA graphs. Commands: serve starts an OpenAI-compatible HTTP server; generate completes "
    "prompts offline; compile fills the compile cache so later starts are warm; cache lists or "
    "clears that cache; passes report shows what fusion passes do to a model; ops lists vgraph's custom ops or checks their Triton kernels; doctor checks "
    "the CUDA path on this machine. serve, generate and compile take a model (a local Hugging Face "
    "directory or a hub id) and run the built-in demo model without one. 'vgraph COMMAND --help' "
    "lists a command's options.")
EPILOG = ("environment: VGRAPH_CACHE_DIR (compile cache; default ~/.cache/vgraph), "
          "VGRAPH_LOGGING_LEVEL (default level of --log-level), VGRAPH_API_KEY (serve's --api-key)")
LOG_LEVELS = list(logging_setup.LEVELS)


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

    from vgraph.config import resolve_device
    device = resolve_device(device)
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


class _CommandParser(argparse.ArgumentParser):
    """A sub-command's parser whose ``deferred`` arguments are added when it is first used, to
    parse or to print help. The engine flags come from vgraph.config, which imports torch
    (1.5 s): ``vgraph --help`` or a mistyped command should not wait for that."""

    def __init__(self, *args: Any, deferred: Optional[Callable[[argparse.ArgumentParser], None]] = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deferred = deferred

    def _add_deferred(self) -> None:
        add, self._deferred = self._deferred, None
        if add is not None:
            add(self)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self._add_deferred()
        return super().parse_known_args(args, namespace)

    def format_usage(self) -> str:
        self._add_deferred()
        return super().format_usage()

    def format_help(self) -> str:
        self._add_deferred()
        return super().format_help()


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """One option per engine setting: every field of the config dataclasses (vgraph.config),
    named, typed, defaulted and documented from the field, so flags, ``LLM(**kwargs)`` and the
    config cannot disagree. The dest of each option is the field's name."""
    from vgraph.config import SECTIONS
    notes = _here_notes()
    for section, kind in SECTIONS.items():
        group = p.add_argument_group(f"engine options ({kind.__name__})")
        add_field_options(group, kind, skip=SECTIONS if section == "engine" else (), notes=notes)
    vllm_compat.add_engine_options(p)


def _here_notes() -> dict[str, str]:
    """What the device-dependent defaults come to on this machine, for their help: the help
    says the rule per device, this says which side of it the user is on."""
    from vgraph.config import CompileConfig, resolve_device
    kind = resolve_device("auto")
    default = CompileConfig()
    custom_ops = "on" if default.resolved_custom_ops(kind, quantized=False) else "off"
    return {"device": f"on this machine: {kind}",
            "cudagraph_mode": f"on this machine ({kind}): {default.resolved_graph_mode(kind).value}",
            "custom_ops": f"on this machine ({kind}, compiled, unquantized): {custom_ops}"}


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``EngineConfig.from_kwargs`` keywords from the parsed engine options (the model apart)."""
    from vgraph.config import FIELD_SECTION
    kwargs = {name: getattr(args, name) for name in FIELD_SECTION}
    if args.compilation_config is not None:
        _apply_compilation_config(kwargs, args.compilation_config)
    kwargs["passes"] = [_load_pass(spec) for spec in kwargs["passes"]]
    return kwargs


def _apply_compilation_config(kwargs: dict[str, Any], text: str) -> None:
    """``-O``: its CompileConfig fields into ``kwargs``, unless a field's own flag disagrees."""
    import dataclasses

    from vgraph.cli_options import field_default, shown
    from vgraph.config import CompileConfig
    compile_fields = dataclasses.fields(CompileConfig)
    defaults = {f.name: field_default(f) for f in compile_fields}
    flags = {f.name: f.metadata.get("flag", "--" + f.name.replace("_", "-")) for f in compile_fields}
    fields = vllm_compat.compilation_config(text)
    for name, value in fields.items():
        given = kwargs[name]
        if given != defaults[name] and given != value:
            raise UserError(f"-O/--compilation-config sets {name}={shown(value)} but {flags[name]} "
                            f"gives {shown(given)}")
        kwargs[name] = value


def _load_pass(spec: str) -> Any:
    """``--pass [before:]MODULE:NAME`` or ``--pass [before:]path/to/file.py:NAME`` (see
    vgraph/passes/loading.py); a class is instantiated without arguments. MODULE may also be a
    file in the current directory, as with ``python -m`` (the ``vgraph`` script's sys.path
    does not hold it); appended, so it never shadows an installed module."""
    from vgraph.passes.loading import PassSpecError, load_pass
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        return load_pass(spec)
    except PassSpecError as exc:
        raise UserError(f"--pass {spec!r}: {exc.reason}") from None


# Engine settings `passes report` decides itself: each variant's passes, and a cold compile.
_REPORT_SETS = ("level", "enable_fusion", "use_cache", "dump_graphs_dir")


def _add_report_args(p: argparse.ArgumentParser) -> None:
    """``passes report``: its own flags, then the engine's (those it does not set itself)."""
    from vgraph.config import SECTIONS
    g = p.add_argument_group("report options")
    g.add_argument("--no-default-passes", dest="default_passes", action="store_false",
                   help="study only the --pass passes, without vgraph's own fusion passes (included by default)")
    g.add_argument("--tokens", type=int, default=16,
                   help="greedy tokens generated per prompt for the agreement check (default: 16)")
    g.add_argument("--repeats", type=int, default=5, help="timed rounds per batch bucket (default: 5)")
    g.add_argument("--decode-sizes", type=int, nargs="*", default=[1, 8, 32],
                   help="decode buckets timed, in sequences (default: 1 8 32)")
    g.add_argument("--prefill-tokens", type=int, default=128,
                   help="tokens of the timed prefill; 0 skips it (default: 128)")
    g.add_argument("--out", default="pass-report",
                   help="directory for report.md, report.json and graphs/ (default: ./pass-report)")
    notes = _here_notes()
    for section, kind in SECTIONS.items():
        group = p.add_argument_group(f"engine options ({kind.__name__}), for both variants")
        skip = (*SECTIONS, *_REPORT_SETS) if section == "engine" else _REPORT_SETS
        add_field_options(group, kind, skip=skip, notes=notes)


def _cmd_passes(args: argparse.Namespace) -> int:
    """``passes report``: compiles the model without and with the passes under study and writes
    the report (vgraph/lab/report.py); prints where it is and its headline figures."""
    from vgraph.config import FIELD_SECTION
    for flag, value in (("--tokens", args.tokens), ("--repeats", args.repeats)):
        if value < 1:
            raise UserError(f"{flag} must be at least 1, got {value}")
    kwargs = {name: getattr(args, name) for name in FIELD_SECTION if hasattr(args, name)}
    studied = [_load_pass(spec) for spec in kwargs.pop("passes")]
    if not studied and not args.default_passes:
        raise UserError("--no-default-passes without --pass leaves no pass to study")
    from vgraph.lab import report
    from vgraph.models.demo import DEMO_MODEL_NAME
    model = args.model or DEMO_MODEL_NAME
    if args.model:
        _check_model(args.model)
    kwargs.pop("model", None)
    result = report(model, studied, default_passes=args.default_passes, tokens=args.tokens, out=args.out,
                    repeats=args.repeats, decode_sizes=args.decode_sizes,
                    prefill_tokens=args.prefill_tokens or None, **kwargs)
    data = result.data
    print(f"passes:        {' -> '.join(data['config']['run_order']) or 'none'}")
    print("matches:       " + ", ".join(f"{name}={t['piece_instances']} sites ({t['distinct_graphs']} in distinct "
                                        f"graphs)" for name, t in data["matches"]["per_pass"].items()))
    for dtype, n in data["numerics"].items():
        print(f"{dtype + ':':<14} logits max |diff| {n['logits']['max_abs']:.3g}, greedy agreement "
              f"{n['greedy']['agreement']:.0%} over {n['greedy']['tokens']} tokens")
    print("step time:     " + ", ".join(f"{name} {row['speedup']:.2f}x" for name, row in data["step_times"].items())
          + " (with vs without passes)")
    print(f"report:        {result.markdown_path}")
    print(f"data:          {result.json_path}")
    return 0


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    """generate's sampling flags: SamplingParams fields, greedy by default."""
    g = p.add_argument_group("sampling options (SamplingParams)")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per completion (default: 64)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0.0)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0, off)")
    g.add_argument("--top-k", type=int, default=-1, help="sample from the k likeliest tokens (default: -1, off)")
    g.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens below this fraction of the likeliest one's probability (default: 0.0, off)")
    g.add_argument("--sampling-seed", type=int, default=None,
                   help="seed of the sampling (default: none, i.e. unseeded; --seed seeds the engine)")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divides the logits of tokens seen so far (default: 1.0, off)")
    g.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtracted from tokens already generated (default: 0.0)")
    g.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtracted per earlier occurrence of a token (default: 0.0)")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable; default: none)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating after end-of-sequence (off by default)")
    g.add_argument("--n", type=int, default=1, help="completions per prompt (default: 1)")


def _add_model_positional(p: argparse.ArgumentParser, verb: str) -> None:
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help=f"the model to {verb}: a local Hugging Face directory or a hub id (same as --model; "
                        "default: the built-in demo model, also named demo-model-v1)")


def _merge_model(args: argparse.Namespace) -> None:
    """``MODEL`` and ``--model`` are one setting; giving two different ones is an error."""
    tag = getattr(args, "model_tag", None)
    if tag is None:
        return
    if args.model is not None and args.model != tag:
        raise UserError(f"two models given: {tag!r} and --model {args.model!r}")
    args.model = tag


# A Hugging Face Hub id: "name" or "owner/name", letters, digits, "-", "_" and ".".
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def _check_model(model: str) -> None:
    """Rejects a model that can only fail, before anything loads or listens: a path that is
    not a directory, a directory without config.json, a name that is no hub id. A well-formed
    hub id passes (fetching it is the loader's job, and its error is as clear)."""
    from vgraph.models.demo import DEMO_MODEL_NAME
    path = os.path.expanduser(model)
    if model == DEMO_MODEL_NAME or os.path.isdir(path):
        if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
            raise UserError(f"model directory {model!r} has no config.json (not a Hugging Face model directory)")
        return
    if os.path.exists(path) or model.startswith(("/", "./", "../", "~")):
        missing = "" if os.path.exists(path) else " (nothing exists there)"
        raise UserError(f"model path {model!r} is not a directory{missing}")
    if not _HUB_ID.fullmatch(model) or ".." in model:
        raise UserError(f"model {model!r} is neither a local directory nor a Hugging Face Hub id (owner/name)")


def _model_path(args: argparse.Namespace) -> str:
    if args.model:
        _check_model(args.model)
        return args.model
    from vgraph.models.demo import demo_model_dir
    logging.getLogger("vgraph").warning("no --model given: using the built-in demo model "
                                        "(a small Llama that writes Python; not a chat assistant)")
    return demo_model_dir()


def _llm_from_args(args: argparse.Namespace, kwargs: Optional[dict[str, Any]] = None):
    """The LLM the engine options describe; ``kwargs``: those options, already converted."""
    from vgraph import LLM
    kwargs = _engine_kwargs(args) if kwargs is None else kwargs  # a bad --pass fails before any loading
    return LLM(_model_path(args), **kwargs)


def _cmd_doctor(args: argparse.Namespace) -> int:
    """Checks the CUDA path; exits 1 (with one line) on a machine without CUDA."""
    import torch

    from vgraph import doctor
    return doctor.run(torch.device("cuda"))


def _cmd_compile(args: argparse.Namespace) -> int:
    """Compiles what `serve`/`generate` will need and stores it in the compile cache."""
    import time

    from vgraph.config import CompileLevel
    if args.level is CompileLevel.NONE:
        raise UserError("--enforce-eager turns compilation off; nothing to compile")
    start = time.perf_counter()
    engine = _llm_from_args(args).engine
    c = engine.runner.compile_counters
    # Tensor parallelism: rank 0's counters, and every rank's entry (each compiles its shard).
    folders = getattr(engine.runner, "compile_cache_folders", None) or [engine.runner.compile_cache.folder]
    print(f"model:          {engine.config.model.model}")
    print(f"pieces:         {c.pieces} ({c.compiled_pieces} compiled, {c.unique_piece_graphs} distinct graphs)")
    print(f"inductor:       {c.inductor_compilations} compilations in {c.inductor_seconds:.2f} s")
    print(f"cache loads:    {c.cache_loads} in {c.cache_load_seconds:.2f} s; saves: {c.cache_saves}")
    print(f"captured graph: {_captured_status(c.captured_graph)}")
    print(f"served by:      the {c.rung} rung of the compile ladder")
    print(f"runnables:      {_runnable_status(c)}")
    print("pass matches:   " + (", ".join(f"{k}={v}" for k, v in c.pass_matches.items()) or "none"))
    print(f"cache folder:   {', '.join(map(str, folders))}")
    print(f"total:          {time.perf_counter() - start:.2f} s")
    return 0


def _runnable_status(c: Any) -> str:
    """The warm start's fast path (compiler/warm_start.py): pieces run without Inductor."""
    if c.runnable_loads:
        return f"{c.runnable_loads} loaded (Dynamo and Inductor not imported)"
    if c.runnable_saves:
        return f"{c.runnable_saves} saved (warm starts import neither Dynamo nor Inductor)"
    return "none (warm starts load the pieces through Inductor)"


def _captured_status(state: str) -> str:
    return {"saved": "saved (warm starts skip Dynamo)", "loaded": "loaded from the cache (Dynamo skipped)"}.get(
        state, "not recorded (warm starts trace with Dynamo)")


def _cmd_cache(args: argparse.Namespace) -> int:
    """``cache list`` (``ls``) / ``cache clear``, both narrowed by ENTRY, --model and
    --older-than (entries every given selector accepts); a plain ``clear`` removes every
    entry. ``cache prune`` keeps the directory bounded by age and/or size."""
    from vgraph.compiler import cache_entries as ce
    from vgraph.paths import cache_dir
    root = cache_dir()
    selectors = (args.entry, args.model, args.older_than)
    older = ce.parse_duration(args.older_than) if args.older_than is not None else None
    if args.action == "prune":
        return _cache_prune(args, root, older)
    if args.max_size is not None:
        raise UserError("--max-size goes with `vgraph cache prune`")
    if args.action == "clear" and selectors == (None, None, None):
        print(f"removed {ce.clear_all(root)} compile cache entries from {root / 'compile'}")
        return 0
    entries = ce.select_entries(ce.list_entries(root), args.entry, args.model, older)
    if args.action == "clear":
        print(f"removed {ce.remove_entries(entries)} compile cache entries from {root / 'compile'}")
        return 0
    print(f"compile cache: {root / 'compile'} ({len(entries)} entries)")
    for entry in entries:
        print(ce.describe_entry(entry))
    return 0


def _cache_prune(args: argparse.Namespace, root: Any, older: Optional[float]) -> int:
    """Removes entries unused for --older-than, then the least recently used until the rest
    fit in --max-size; at least one is required (a bare prune would guess a budget)."""
    from vgraph.compiler import cache_entries as ce
    if args.entry is not None or args.model is not None:
        raise UserError("prune takes --older-than and --max-size; to remove chosen entries use `vgraph cache clear`")
    max_size = ce.parse_size(args.max_size) if args.max_size is not None else None
    if older is None and max_size is None:
        raise UserError("prune needs --older-than AGE and/or --max-size SIZE, e.g. --max-size 2G")
    result = ce.prune(root, older, max_size)
    freed = sum(e.bytes for e in result.removed)
    print(f"removed {len(result.removed)} compile cache entries ({ce.format_size(freed)}) from {root / 'compile'}; "
          f"{result.left} left ({ce.format_size(result.left_bytes)})")
    for entry in result.busy:
        print(f"kept {entry.name}: a process is compiling into it now")
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
    """The server's own flags that no ServerSettings field describes (named as in vLLM); the
    settings' and the engine's come deferred (``_add_serve_deferred``)."""
    _add_model_positional(p, "serve")
    g = p.add_argument_group("server options")
    g.add_argument("--host", default="0.0.0.0", help="address to listen on (default: 0.0.0.0, all interfaces)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one (default: 8000)")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use in 'model' (default: the model as given, or demo-model-v1)")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $VGRAPH_API_KEY, else none)")
    g.add_argument("--chat-template", default=None,
                   help="a Jinja chat template, or a file holding one (default: the tokenizer's)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may take to finish after SIGTERM (default: 30.0)")
    g.add_argument("--access-log", action="store_true", help="log every HTTP request (off by default)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="vLLM's switch for tool_choice auto; vgraph reads tool calls whenever "
                        "--tool-call-parser is given, which this flag requires (off by default)")
    g.add_argument("--engine-in-process", action="store_true",
                   help="run the engine (scheduler and model) on a thread of the server process instead of "
                        "in its own engine-core process (the default), as the library LLM does: for tests "
                        "and research")
    g.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                   help="independent engine replicas (each its own scheduler, model copy and KV cache) behind "
                        "this one server, requests routed to the least loaded one, or to the one that served "
                        "their prompt prefix; each gets 1/N of the CPU threads (on CUDA: replica i uses cuda:i), and "
                        "--max-queue-len and --kv-cache-gib apply to each; each is an engine-core process, or "
                        "a thread of the server with --engine-in-process (default: 1)")


def _add_serve_deferred(p: argparse.ArgumentParser) -> None:
    """The ServerSettings fields with help (one flag each, as the engine's) and the engine's."""
    from vgraph.server.state import ServerSettings
    add_field_options(p.add_argument_group("server limits (ServerSettings)"), ServerSettings)
    _add_engine_args(p)


def _server_settings(args: argparse.Namespace, model: Optional[str]):
    """ServerSettings from the parsed flags: every field with help from its own flag, the rest
    from the hand-written ones. A bad value is the dataclass's ValueError (exit 2)."""
    import dataclasses

    from vgraph.models.demo import DEMO_MODEL_NAME
    from vgraph.server.state import ServerSettings
    flagged = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServerSettings) if "help" in f.metadata}
    return ServerSettings(served_model_names=args.served_model_name or [model or DEMO_MODEL_NAME],
                          api_key=args.api_key or os.environ.get("VGRAPH_API_KEY") or None,
                          chat_template=_chat_template(args.chat_template), **flagged)


def _listen(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound now, before the model loads: a port in use is one
    line and exit 2 at once (not an uvicorn error after minutes of compiling), and uvicorn is
    handed this very socket, so nothing can take the port in between."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not the default 0: asyncio sets TCP_NODELAY only on accepted sockets whose
    # protocol says TCP, and without it Nagle plus the client's delayed ACK held every
    # keep-alive response back ~40 ms.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT is no obstacle
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise UserError(_bind_error(host, port, exc)) from None
    return sock


def _bind_error(host: str, port: int, exc: OSError) -> str:
    if exc.errno == errno.EADDRINUSE:
        return f"port {port} on {host} is in use (another server is listening there); choose another --port"
    if exc.errno == errno.EACCES:
        return f"port {port} on {host}: permission denied (ports below 1024 need privileges)"
    return f"cannot listen on {host}:{port}: {exc.strerror or exc}"


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
    """Serves the OpenAI-compatible API until SIGTERM (exit 0) or a fatal engine error (exit 1).

    Everything that can be wrong with the command line is checked first, then the port is
    bound; only then does the model load (in the engine-core process, or on the engine thread
    with --engine-in-process; /health answers 503 meanwhile)."""
    for flag, value, low in (("--port", args.port, 0), ("--max-queue-len", args.max_queue_len, 1),
                             ("--shutdown-timeout", args.shutdown_timeout, 0),
                             ("--data-parallel-size", args.data_parallel_size, 1)):
        if value is not None and value < low:
            raise UserError(f"{flag} must be at least {low}, got {value}")
    if args.port > 65535:
        raise UserError(f"--port must be at most 65535, got {args.port}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise UserError("--enable-auto-tool-choice needs --tool-call-parser (hermes or llama3_json)")
    if args.lora_modules and not args.enable_lora:
        raise UserError("--lora-modules needs --enable-lora")
    from vgraph.engine import launch
    launch.prepare_environment()  # before torch loads
    from vgraph.config import EngineConfig
    from vgraph.models.demo import DEMO_MODEL_NAME
    from vgraph.server.lifecycle import serve
    settings = _server_settings(args, args.model)
    kwargs = _engine_kwargs(args)
    EngineConfig.from_kwargs(args.model or DEMO_MODEL_NAME, **kwargs)  # bad values: exit 2, not a dead engine
    if args.model:
        _check_model(args.model)
    sock = _listen(args.host, args.port)
    host, port = sock.getsockname()[:2]
    logging.getLogger("vgraph.server").info("listening on http://%s:%d (/health answers 503 until the model "
                                            "is loaded)", f"[{host}]" if ":" in host else host, port)
    topology = launch.ServingTopology(model=_model_path(args), engine_kwargs=kwargs, pass_specs=list(args.passes),
                               in_process=args.engine_in_process, data_parallel_size=args.data_parallel_size,
                               max_queue_len=settings.max_queue_len, log_level=args.log_level)
    try:
        engine = launch.serving_engine(topology)
    except launch.TopologyError as exc:
        raise UserError(str(exc)) from None
    with sock:
        return serve(settings, engine, host=args.host, port=port, shutdown_timeout=args.shutdown_timeout,
                     log_level=args.log_level, access_log=args.access_log, sockets=[sock])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vgraph", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--version", action=_Version, help="print vgraph's version (and torch's, triton's, "
                                                              "transformers', Python's) and exit")
    _add_global_options(parser)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_CommandParser, metavar="COMMAND")
    ops = sub.add_parser("ops", help="list the custom ops or check every Triton kernel against its reference")
    ops.add_argument("action", choices=["list", "check"],
                     help="list: print each op's schema; check: run every Triton kernel against its plain-torch "
                          "reference and print the errors (interpreted on CPU, compiled on CUDA)")
    ops.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                     help="where the kernels run (default: auto, cuda when available, else cpu)")
    ops.set_defaults(handler=_cmd_ops)
    gen = sub.add_parser("generate", help="generate completions for prompts offline", deferred=_add_engine_args)
    _add_model_positional(gen, "run")
    gen.add_argument("--prompt", action="append", required=True, help="a prompt (repeatable; required)")
    _add_sampling_args(gen)
    gen.set_defaults(handler=_cmd_generate)
    comp = sub.add_parser("compile", help="fill the compile cache ahead of time so later starts are warm",
                          deferred=_add_engine_args)
    _add_model_positional(comp, "compile")
    comp.set_defaults(handler=_cmd_compile)
    doctor = sub.add_parser("doctor", help="check the CUDA path on this machine: kernels, graph capture, "
                                           "replay vs eager (about a minute on a GPU)")
    doctor.set_defaults(handler=_cmd_doctor)
    passes = sub.add_parser("passes", help="compile a model without and with fusion passes and report matches, "
                                           "graph diffs, numerics, step times and Inductor's kernels",
                            deferred=_add_report_args)
    passes.add_argument("action", choices=["report"],
                        help="report: write report.md and report.json (see vgraph/lab/report.py)")
    _add_model_positional(passes, "report on")
    passes.set_defaults(handler=_cmd_passes)
    cache = sub.add_parser("cache", help="list, clear or prune compile cache entries ($VGRAPH_CACHE_DIR)")
    cache.add_argument("action", choices=["list", "ls", "clear", "prune"],
                       help="list (or ls): each entry's model, key fields, size, creation and last use; "
                            "clear: remove the selected entries (all without a selector); prune: remove "
                            "entries by --older-than and/or --max-size")
    cache.add_argument("entry", nargs="?", default=None, help="only this entry: its name or a unique prefix")
    cache.add_argument("--model", default=None, help="only entries made for this model (as given, or its directory)")
    cache.add_argument("--older-than", default=None, metavar="AGE",
                       help="only entries last used longer ago than AGE: 30m, 12h, 7d, 2w")
    cache.add_argument("--max-size", default=None, metavar="SIZE",
                       help="prune: then remove the least recently used entries until the rest take at most "
                            "SIZE: 500M, 2G (powers of 1024)")
    cache.set_defaults(handler=_cmd_cache)
    srv = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API (default model: the demo model)",
                         deferred=_add_serve_deferred)
    _add_serve_args(srv)
    srv.set_defaults(handler=_cmd_serve)
    for command in sub.choices.values():  # global options are accepted after the command too
        _add_global_options(command)
    return parser


def _add_global_options(p: argparse.ArgumentParser) -> None:
    """Options every command takes, before or after its name. The default is SUPPRESS on the
    top-level parser and on each command's, so a command that was not given one does not
    overwrite the value given before it; ``_log_level`` supplies the real default."""
    p.add_argument("--log-level", default=argparse.SUPPRESS, choices=LOG_LEVELS, type=str.upper,
                   help="log level (default: $VGRAPH_LOGGING_LEVEL, else INFO)")


class _Version(argparse.Action):
    """``--version``: one unwrapped line (argparse's own action wraps it like help text)."""

    def __init__(self, option_strings: list[str], dest: str, help: Optional[str] = None) -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option: Any = None) -> None:
        print(_version_text())
        parser.exit()


def _version_text() -> str:
    """vgraph's version and those of what it runs on, read without importing them."""
    from importlib import metadata
    parts = []
    for dist in ("torch", "triton", "transformers"):
        try:
            parts.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{dist} not installed")
    python = ".".join(map(str, sys.version_info[:3]))
    return f"vgraph {__version__} ({', '.join(parts)}, Python {python})"


def _log_level(args: argparse.Namespace) -> str:
    """--log-level, else $VGRAPH_LOGGING_LEVEL (a bad value is a user error), else INFO."""
    given = getattr(args, "log_level", None)
    if given:
        return given
    try:
        return logging_setup.env_level() or "INFO"
    except ValueError as exc:
        raise UserError(str(exc)) from None


def parse_args(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """``parser.parse_args``, except that arguments the command does not know are reported by
    the command's parser, with its usage (argparse reports them with the top-level one)."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        sub.choices[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(build_parser(), argv)
    try:
        args.log_level = _log_level(args)
    except UserError as exc:
        print(f"vgraph {args.command}: error: {exc}", file=sys.stderr)
        return 2
    # The root logger gets the handler, so vgraph's own (logging_setup) stays quiet: one line
    # per record, in the same format as the Python API's.
    logging.basicConfig(level=args.log_level, format=logging_setup.FORMAT, datefmt=logging_setup.DATE_FORMAT)
    logging_setup.set_level(args.log_level)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        _merge_model(args)
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
