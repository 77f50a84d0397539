"""Settings written once: each service has one dataclass whose fields carry their default and
help. Its command-line flags, the parsing of them, and the command line `tinkerd up` builds for
the child process are all derived from that dataclass, so no default is written twice and no
flag can be forgotten on the way to a child.

    @dataclasses.dataclass
    class SamplerSettings:
        base_model: str = setting(help="...")                 # required (no default)
        max_loras: int = setting(4, help="...")               # --max-loras N
        aliases: list[str] = setting([], flag="alias", help="...")   # --alias A --alias B
"""

from __future__ import annotations

import argparse
import dataclasses
import typing

_REQUIRED = dataclasses.MISSING


def setting(default=_REQUIRED, *, help: str, flag: str | None = None, choices=None, at_least=None, above=None):
    """A settings field. `flag` overrides the flag's name (default: the field name in kebab-case);
    a list default makes a repeatable flag. `at_least` / `above`: a number's bounds, checked as the
    flag is parsed (a usage error naming the flag, not a service that dies later)."""
    metadata = {"help": help, "flag": flag, "choices": choices, "at_least": at_least, "above": above}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def flag_name(field: dataclasses.Field) -> str:
    return "--" + (field.metadata.get("flag") or field.name).replace("_", "-")


def default_of(field: dataclasses.Field):
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def _kind(cls, field: dataclasses.Field) -> type:
    hint = typing.get_type_hints(cls)[field.name]
    if typing.get_origin(hint) is list:
        return list
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def fields(cls) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


def add_arguments(parser: argparse.ArgumentParser, cls, *, skip: tuple[str, ...] = ()) -> None:
    """One flag per field of `cls`, except those named in `skip`."""
    for field in fields(cls):
        if field.name in skip:
            continue
        kind, default = _kind(cls, field), default_of(field)
        kwargs = {"dest": field.name, "help": field.metadata["help"]}
        if default is _REQUIRED:
            kwargs["required"] = True
        else:
            kwargs["default"] = default
            if default not in (None, []):
                kwargs["help"] += f" (default: {default})"
        if field.metadata.get("choices"):
            kwargs["choices"] = field.metadata["choices"]
        if kind is list:
            kwargs["action"] = "append"      # onto None, not onto the shared default list
            kwargs["default"] = None
        elif kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = _bounded(kind, field.metadata.get("at_least"), field.metadata.get("above"))
        parser.add_argument(flag_name(field), **kwargs)


def _bounded(kind: type, at_least, above):
    """`kind` as argparse's type, refusing values out of bounds with what is allowed."""
    if at_least is None and above is None:
        return kind

    def parse(text: str):
        value = kind(text)
        if at_least is not None and value < at_least:
            raise argparse.ArgumentTypeError(f"must be at least {at_least}, got {text}")
        if above is not None and not value > above:
            raise argparse.ArgumentTypeError(f"must be more than {above}, got {text}")
        return value
    parse.__name__ = kind.__name__          # argparse's "invalid int value" names the type by it
    return parse


def from_args(cls, args: argparse.Namespace, **overrides):
    """The settings object from parsed flags; fields without a flag value keep their default, and
    `overrides` (e.g. how `tinkerd up` wires children together) win."""
    values = {f.name: getattr(args, f.name) for f in fields(cls) if getattr(args, f.name, None) is not None}
    return cls(**{**values, **overrides})


def to_argv(settings) -> list[str]:
    """The flags that reproduce `settings` (every field, defaults included)."""
    argv: list[str] = []
    for field in fields(type(settings)):
        value, name = getattr(settings, field.name), flag_name(field)
        kind = _kind(type(settings), field)
        if value is None:
            continue
        if kind is list:
            for item in value:
                argv += [name, str(item)]
        elif kind is bool:
            argv.append(name if value else "--no-" + name[2:])
        else:
            argv += [name, str(value)]
    return argv
