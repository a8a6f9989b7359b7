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

        import vgraph.ops  # noqa: F401
        for name in sorted(n for n in dir(torch.ops.vgraph) if not n.startswith("_") and n != "name"):
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vgraph", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True)
    ops = sub.add_parser("ops", help="list the custom ops or check every Triton kernel against its reference")
    ops.add_argument("action", choices=["list", "check"])
    ops.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ops.set_defaults(handler=_cmd_ops)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except (UserError, ValueError, FileNotFoundError) as exc:
        print(f"vgraph {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
