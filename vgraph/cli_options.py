"""Command-line options made from dataclass fields: the flag, type, default and help of each
option come from its field, so a setting's default is written once (in its dataclass) and the
CLI cannot drift from ``LLM(**kwargs)`` or ``ServerSettings``.

A field becomes an option when its ``metadata`` has "help" (``vgraph.config.cli`` builds that
metadata); the other keys it may carry are listed there. Nothing here imports torch.
"""
from __future__ import annotations

import argparse
import dataclasses
import enum
import re
import typing
from typing import Any, Callable, Iterable, Mapping, Optional


def add_field_options(group: Any, kind: type, skip: Iterable[str] = (),
                      notes: Optional[Mapping[str, str]] = None) -> list[str]:
    """Adds one option per field of the dataclass ``kind`` that has help metadata (``skip``
    aside) to ``group``; ``notes[name]`` is appended to that field's help (e.g. what a
    device-dependent default is on this machine). Returns the names of the fields added."""
    hints = typing.get_type_hints(kind)
    added = []
    for f in dataclasses.fields(kind):
        if f.name in skip or "help" not in f.metadata:
            continue
        flags, options = field_option(f, hints[f.name], (notes or {}).get(f.name))
        group.add_argument(*flags, **options)
        added.append(f.name)
    return added


def field_option(f: dataclasses.Field, hint: Any, note: Optional[str] = None) -> tuple[list[str], dict[str, Any]]:
    """The flags (the field's own first, then its ``aliases``) and ``add_argument`` keywords of
    one field; the option's dest is the field's name."""
    meta, default = f.metadata, field_default(f)
    text = meta["help"] + (f" ({note})" if note else "")
    flag = meta.get("flag", "--" + f.name.replace("_", "-"))
    aliases = list(meta.get("aliases", ()))
    options: dict[str, Any] = {"dest": f.name, "default": default}
    if "value" in meta:  # e.g. --enforce-eager stores CompileLevel.NONE into level
        return [flag, *aliases], {**options, "action": "store_const", "const": meta["value"],
                                  "help": _help(f"{text}; sets {f.name}={shown(meta['value'])}", default)}
    if hint is bool or hint == Optional[bool]:
        return _bool_option(f, flag, options, text)
    options.update(type=_scalar_type(hint), metavar=flag.lstrip("-").replace("-", "_").upper(),
                   help=_help(text, default))
    if "nargs" in meta:
        options.update(nargs=meta["nargs"])
    elif typing.get_origin(hint) is list or hint is list:
        options.update(action="append")  # a list given one value per flag (--pass A --pass B)
    if "choices" in meta:
        options.update(choices=meta["choices"], metavar=None)
    return [flag, *aliases], options


def _bool_option(f: dataclasses.Field, flag: str, options: dict[str, Any],
                 text: str) -> tuple[list[str], dict[str, Any]]:
    """True by default: a ``negative`` flag (``--no-x`` unless the metadata names another) turns
    it off, and so do its ``aliases``; a ``positive`` flag (vLLM's explicit spelling of the
    default, e.g. --enable-prefix-caching) turns it back on. Unset by default (None): ``--x`` /
    ``--no-x``. False by default: the flag (or an alias) turns it on."""
    default, aliases = options["default"], list(f.metadata.get("aliases", ()))
    if default is None:
        return [flag], {**options, "action": argparse.BooleanOptionalAction, "help": _help(text, None)}
    if default:
        negative = f.metadata.get("negative", "--no-" + flag[2:])
        positive = f.metadata.get("positive")
        if positive is None:
            return [negative, *aliases], {**options, "action": "store_false",
                                          "help": escape(f"turns off: {text} (on by default)")}
        return [negative, *aliases, positive], {
            **options, "action": _Switch, "on": [positive],
            "help": escape(f"turns off: {text} (on by default; {positive} turns it on)")}
    return [flag, *aliases], {**options, "action": "store_true", "help": escape(f"{text} (off by default)")}


class _Switch(argparse.Action):
    """One boolean setting under several flags: those in ``on`` store True, the others False.
    One action rather than two, so the setting keeps one dest and one default."""

    def __init__(self, option_strings: list[str], dest: str, on: Iterable[str] = (), **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, **kwargs)
        self.on = frozenset(on)

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Optional[str] = None) -> None:
        setattr(namespace, self.dest, option_string in self.on)


def field_default(f: dataclasses.Field) -> Any:
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


# Help that explains its default itself: "Default: ...", "(default: ...)", "(default and ceiling: ...)".
_EXPLAINS_DEFAULT = re.compile(r"\bdefault\b[\w ]*:", re.IGNORECASE)


def _help(text: str, default: Any) -> str:
    """The field's help, and its default unless the help already explains it."""
    if _EXPLAINS_DEFAULT.search(text):
        return escape(text)
    return escape(f"{text} (default: {shown(default)})")


def shown(value: Any) -> str:
    """A default as a user would type it."""
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, list):
        return " ".join(map(shown, value)) or "none"
    return "none" if value is None else str(value)


def escape(text: str) -> str:
    return text.replace("%", "%%")  # argparse %-formats help strings
