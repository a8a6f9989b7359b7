"""The ``vgraph`` command line.

Sub-commands import their heavy modules lazily, so ``vgraph --help`` is instant and a bad
flag fails before torch loads. User errors print one line and exit 2, never a traceback.
"""
from __future__ import annotations

import argparse
import dataclasses
import enum
import importlib
import logging
import os
import sys
import typing
from typing import Any, Callable, Optional, Sequence


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
    for section, kind in SECTIONS.items():
        group = p.add_argument_group(f"engine options ({kind.__name__})")
        hints = typing.get_type_hints(kind)
        for f in dataclasses.fields(kind):
            if not (section == "engine" and f.name in SECTIONS):  # not EngineConfig.model, .cache...
                flag, options = _field_option(f, hints[f.name])
                group.add_argument(flag, **options)


def _field_option(f: dataclasses.Field, hint: Any) -> tuple[str, dict[str, Any]]:
    """The flag and ``add_argument`` keywords of one config field (see ``vgraph.config.cli``)."""
    meta, default = f.metadata, _field_default(f)
    flag = meta.get("flag", "--" + f.name.replace("_", "-"))
    options: dict[str, Any] = {"dest": f.name, "default": default}
    if "value" in meta:  # e.g. --enforce-eager stores CompileLevel.NONE into level
        return flag, {**options, "action": "store_const", "const": meta["value"],
                      "help": _help(f"{meta['help']}; sets {f.name}={_shown(meta['value'])}", default)}
    if hint is bool or hint == Optional[bool]:
        return _bool_option(f, flag, options)
    options.update(type=_scalar_type(hint), metavar=flag.lstrip("-").replace("-", "_").upper(),
                   help=_help(meta["help"], default))
    if "nargs" in meta:
        options.update(nargs=meta["nargs"])
    elif typing.get_origin(hint) is list or hint is list:
        options.update(action="append")  # a list given one value per flag (--pass A --pass B)
    if "choices" in meta:
        options.update(choices=meta["choices"], metavar=None)
    return flag, options


def _bool_option(f: dataclasses.Field, flag: str, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """True by default with a ``negative`` flag: that flag turns it off. Unset by default (None):
    ``--x`` / ``--no-x``. False by default: the flag turns it on."""
    meta, default = f.metadata, options["default"]
    if default is None:
        return flag, {**options, "action": argparse.BooleanOptionalAction, "help": _help(meta["help"], None)}
    if default:
        return meta["negative"], {**options, "action": "store_false",
                                  "help": _escape(f"off: {meta['help']} (on by default)")}
    return flag, {**options, "action": "store_true", "help": _escape(f"{meta['help']} (off by default)")}


def _field_default(f: dataclasses.Field) -> Any:
    """The dataclass default (a fresh one from a factory); None for a required field (the model:
    none given means the demo model)."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _scalar_type(hint: Any) -> Callable[[str], Any]:
    """What argparse converts each value with: the annotation without Optional or list[...].
    Anything but int and float stays a str (``torch.dtype``, ``CudaGraphMode``): the config
    converts those itself, and their choices are strings, so a bad one is argparse's "invalid
    choice" naming them."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if args:  # list[X], Optional[X], X | Y: the first
        return _scalar_type(args[0])
    return hint if hint in (int, float) else str


def _help(text: str, default: Any) -> str:
    """The field's help, and its default unless the help already explains it."""
    if "default:" in text.lower():
        return _escape(text)
    return _escape(f"{text} (default: {_shown(default)})")


def _shown(value: Any) -> str:
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, list):
        return " ".join(map(_shown, value)) or "none"
    return "none" if value is None else str(value)


def _escape(text: str) -> str:
    return text.replace("%", "%%")  # argparse %-formats help strings


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``EngineConfig.from_kwargs`` keywords from the parsed engine options (the model apart)."""
    from vgraph.config import FIELD_SECTION
    kwargs = {name: getattr(args, name) for name in FIELD_SECTION}
    kwargs["passes"] = [_load_pass(spec) for spec in kwargs["passes"]]
    return kwargs


def _load_pass(spec: str) -> Any:
    """``--pass MODULE:NAME``: the attribute NAME of MODULE, instantiated (no arguments) if it is
    a class, since a pass class is what a user module usually defines. MODULE may also be a
    file in the current directory, as with ``python -m`` (the ``vgraph`` script's sys.path does
    not hold it); appended, so it never shadows an installed module."""
    module_name, sep, attr = spec.partition(":")
    if not (sep and module_name and attr):
        raise UserError(f"--pass {spec!r}: expected MODULE:NAME, e.g. my_passes:MyPass")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        found = getattr(importlib.import_module(module_name), attr)
    except ImportError as exc:
        raise UserError(f"--pass {spec!r}: cannot import {module_name!r} ({exc})") from None
    except AttributeError:
        raise UserError(f"--pass {spec!r}: module {module_name!r} has no attribute {attr!r}") from None
    made = found() if isinstance(found, type) else found
    if not callable(made):
        raise UserError(f"--pass {spec!r}: {type(made).__name__} is not callable on an FX graph")
    return made


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
    c, cache = engine.runner.compile_counters, engine.runner.compile_cache
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
    """``cache list`` / ``cache clear``, both narrowed by ENTRY, --model and --older-than
    (entries every given selector accepts); a plain ``clear`` removes every entry."""
    from vgraph.compiler import cache_entries as ce
    from vgraph.paths import cache_dir
    root = cache_dir()
    selectors = (args.entry, args.model, args.older_than)
    older = ce.parse_duration(args.older_than) if args.older_than is not None else None
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
                             ("--shutdown-timeout", args.shutdown_timeout, 0)):
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
    from vgraph.config import EngineConfig
    from vgraph.models.demo import DEMO_MODEL_NAME
    from vgraph.server.lifecycle import serve
    from vgraph.server.state import ServerSettings
    default_name = args.model if args.model else DEMO_MODEL_NAME
    settings = ServerSettings(served_model_names=args.served_model_name or [default_name],
                              api_key=args.api_key or os.environ.get("VGRAPH_API_KEY") or None,
                              chat_template=_chat_template(args.chat_template), max_queue_len=args.max_queue_len)

    kwargs = _engine_kwargs(args)
    EngineConfig.from_kwargs(args.model or DEMO_MODEL_NAME, **kwargs)  # bad values: exit 2, not a dead engine

    def build_engine():
        """Runs on the engine thread, so /health answers 503 while this loads and compiles."""
        return _llm_from_args(args, kwargs).engine

    return serve(settings, build_engine, host=args.host, port=args.port, shutdown_timeout=args.shutdown_timeout,
                 log_level=args.log_level, access_log=args.access_log)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vgraph", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_CommandParser)
    ops = sub.add_parser("ops", help="list the custom ops or check every Triton kernel against its reference")
    ops.add_argument("action", choices=["list", "check"])
    ops.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ops.set_defaults(handler=_cmd_ops)
    gen = sub.add_parser("generate", help="generate completions for prompts offline", deferred=_add_engine_args)
    gen.add_argument("--prompt", action="append", required=True, help="a prompt (repeatable)")
    _add_sampling_args(gen)
    gen.set_defaults(handler=_cmd_generate)
    comp = sub.add_parser("compile", help="fill the compile cache ahead of time so later starts are warm",
                          deferred=_add_engine_args)
    comp.set_defaults(handler=_cmd_compile)
    doctor = sub.add_parser("doctor", help="check the CUDA path on this machine: kernels, graph capture, "
                                           "replay vs eager (about a minute on a GPU)")
    doctor.set_defaults(handler=_cmd_doctor)
    cache = sub.add_parser("cache", help="list or clear compile cache entries ($VGRAPH_CACHE_DIR)")
    cache.add_argument("action", choices=["list", "clear"])
    cache.add_argument("entry", nargs="?", default=None, help="only this entry: its name or a unique prefix")
    cache.add_argument("--model", default=None, help="only entries made for this model (as given, or its directory)")
    cache.add_argument("--older-than", default=None, metavar="AGE",
                       help="only entries last used longer ago than AGE: 30m, 12h, 7d, 2w")
    cache.set_defaults(handler=_cmd_cache)
    srv = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API (default model: the demo model)",
                         deferred=_add_engine_args)
    _add_serve_args(srv)
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
