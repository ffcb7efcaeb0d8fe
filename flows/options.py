"""CLI options generated from their one declaration: a settings model's fields (``run``, ``sweep``, ``eval``,
``serve``, ``suite``, ``tasks``) or a benchmark function's parameters (``nkv bench``, ``ablation``). Each
becomes ``--field-name`` (and ``--field_name``, the kvpress spelling), with the declared default and
description; a list setting takes a comma-separated list, and the press fields always do (a batch runs every
combination). A command receives them as one dict per group; ``declared(command)`` says which options came
from where, so a test can hold each to its declaration.
"""

from __future__ import annotations

import collections.abc
import functools
import inspect
import typing
from typing import Any, Callable, Optional

import typer
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

import nestedkv
from pipeline.config import BatchOptions, GenerationSettings, PressSettings

# kvpress users' spellings work beside ours.
EXTRA_FLAGS = {"press": ["--press-name"]}


def _flags(name: str, field: Optional[FieldInfo] = None, prefix: str = "") -> list[str]:
    """``--name-dashed``, ``--name_underscored``, and any ``flags`` the declaration adds (another spelling)."""
    name = prefix + name
    dashed = "--" + name.replace("_", "-")
    extra = (field.json_schema_extra or {}).get("flags", []) if field is not None and isinstance(
        field.json_schema_extra, dict) else []
    return [dashed] + ([f"--{name}"] if "_" in name else []) + EXTRA_FLAGS.get(name, []) + list(extra)


def _cli_type(field: FieldInfo) -> Any:
    ann = field.annotation
    args = [a for a in typing.get_args(ann) if a is not type(None)]
    if typing.get_origin(ann) is typing.Literal:
        return str
    if typing.get_origin(ann) is typing.Union and len(args) == 1:
        return Optional[str if typing.get_origin(args[0]) is typing.Literal else args[0]]
    return ann


def choices(name: str, field: FieldInfo) -> tuple[str, ...]:
    """The values a setting takes, for its help: the press registry's names, a registry the field names
    (``json_schema_extra={"choices": fn}``), or a Literal's values (an Optional one's too); none for free
    values."""
    if name in ("press", "presses"):
        return tuple(nestedkv.PRESSES)
    if isinstance(field.json_schema_extra, dict) and "choices" in field.json_schema_extra:
        return tuple(field.json_schema_extra["choices"]())
    ann = field.annotation
    for a in (ann, *typing.get_args(ann)):
        if typing.get_origin(a) is typing.Literal:
            return tuple(str(v) for v in typing.get_args(a))
    return ()


def _help(name: str, field: FieldInfo, suffix: str = "") -> str:
    text, ways = field.description or "", choices(name, field)
    named = all(w in text for w in ways)  # a description that tells each choice already
    return text + suffix + ("" if named else f"; one of: {', '.join(ways)}")


def _option(name: str, annotation: Any, default: Any, help: str, flags: Optional[list[str]] = None,
            param: Optional[str] = None) -> inspect.Parameter:
    opt = typer.Option(default, *(flags or _flags(name)), help=help)
    return inspect.Parameter(param or name, inspect.Parameter.KEYWORD_ONLY, default=opt, annotation=annotation)


def _add(fn: Callable, into: str, params: list[inspect.Parameter],
         convert: Optional[dict[str, Callable]] = None, names: Optional[dict[str, str]] = None,
         fields: Optional[dict[str, FieldInfo]] = None, overridden: tuple[str, ...] = ()) -> Callable:
    """``fn`` with ``params`` added to its signature; their values reach ``fn`` as one dict, ``into``, each
    through ``convert[name]`` where given and under ``names[param]`` (its declared name) where given; a value
    that converts to ``OMIT`` is left out (the declaration's own default applies)."""
    sig = inspect.signature(fn)
    own = [p for p in sig.parameters.values() if p.name != into]
    added = [p.name for p in params]
    convert, names = convert or {}, names or {}

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        values = {names.get(n, n): convert.get(n, lambda v: v)(kwargs.pop(n)) for n in added}
        kwargs[into] = {k: v for k, v in values.items() if v is not OMIT}
        return fn(*args, **kwargs)

    wrapper.__signature__ = sig.replace(parameters=own + params)
    hints = typing.get_type_hints(fn)
    wrapper.__annotations__ = {**{p.name: hints.get(p.name, p.annotation) for p in own},
                               **{p.name: p.annotation for p in params}}
    wrapper.__nkv_declared__ = {**getattr(fn, "__nkv_declared__", {}),
                                **{p: (fields or {}).get(names.get(p, p)) for p in added}}
    wrapper.__nkv_overridden__ = getattr(fn, "__nkv_overridden__", frozenset()) | frozenset(overridden)
    return wrapper


OMIT = object()  # an option left out: the declaration's own default (a default factory, say) applies


def declared(command: Callable) -> tuple[dict[str, Optional[FieldInfo]], frozenset]:
    """The options generated for ``command`` (parameter name -> the field it was generated from, None for an
    option no field holds) and those whose default the command sets itself (a suite's own grid, say)."""
    return dict(getattr(command, "__nkv_declared__", {})), getattr(command, "__nkv_overridden__", frozenset())


def _items(ann: Any) -> Optional[type]:
    """The item type of a list, tuple or sequence setting (an Optional one's too): it takes a comma-separated
    list on the command line."""
    for a in (ann, *typing.get_args(ann)):
        if typing.get_origin(a) in (list, tuple, collections.abc.Sequence):
            args = [x for x in typing.get_args(a) if x is not Ellipsis]
            return args[0] if args else str
    return None


def _splitter(flag: str, item: type) -> Callable:
    def split(value):
        if value is None:
            return None
        try:
            return tuple(item(v.strip()) for v in value.split(",") if v.strip())
        except ValueError:
            raise typer.BadParameter(f"expected a comma-separated list of {item.__name__}, got {value!r}",
                                     param_hint=flag) from None
    return split


def _shown(default: Any) -> Any:
    """A default as the command line spells it: a list comma-separated."""
    if isinstance(default, (list, tuple)):
        return ",".join(map(str, default))
    return default


def cli_default(field: FieldInfo) -> Any:
    """What an option generated from ``field`` defaults to on the command line (None: the declaration's
    default factory or required value applies)."""
    if field.default is PydanticUndefined:
        return None
    return _shown(field.default)


def field_options(fields: dict[str, FieldInfo], into: str, *, prefix: str = "", **defaults) -> Callable:
    """Options for ``fields`` (a settings model's, or ``signature_fields`` of a function), into ``into``: a
    bool is a ``--x/--no-x`` switch, a Literal names its choices in the help, a list is comma-separated.
    ``defaults`` overrides a field's default for this command; ``prefix`` goes before each flag and
    parameter name (two declarations with a name in common in one command)."""
    params, convert, names = [], {}, {}
    for n, f in fields.items():
        param = prefix + n
        flags = _flags(n, f, prefix)
        default = _shown(defaults[n]) if n in defaults else cli_default(f)
        ann, item = _cli_type(f), _items(f.annotation)
        if item is not None:
            ann = Optional[str]
            convert[param] = _splitter(flags[0], item)
        elif ann is bool:  # explicit names: typer adds no --no- form by itself
            flags = [f"{flags[0]}/--no-{flags[0][2:]}", *flags[1:]]
        elif default is None and not _optional(f.annotation):
            ann = Optional[ann]
        if default is None and (f.default_factory is not None or f.default is PydanticUndefined) and \
                n not in defaults:
            inner = convert.get(param, lambda v: v)
            convert[param] = lambda v, inner=inner: OMIT if v is None else inner(v)
        params.append(_option(n, ann, default, _help(n, f), flags, param))
        names[param] = n
    overridden = tuple(prefix + n for n in defaults)
    return lambda fn: _add(fn, into, params, convert, names, fields, overridden)


def _optional(ann: Any) -> bool:
    return typing.get_origin(ann) is typing.Union and type(None) in typing.get_args(ann)


def model_fields(model: type[BaseModel], include: Optional[tuple[str, ...]] = None,
                 exclude: tuple[str, ...] = ()) -> dict[str, FieldInfo]:
    """A settings model's fields, in declaration order (``include``: those, in that order)."""
    names = include if include is not None else tuple(model.model_fields)
    return {n: model.model_fields[n] for n in names if n not in exclude}


def signature_fields(fn: Callable, include: Optional[tuple[str, ...]] = None,
                     exclude: tuple[str, ...] = ()) -> dict[str, FieldInfo]:
    """A function's parameters as fields: the annotation (``Annotated[T, Field(description=...)]`` gives
    the help) and the default, so a benchmark's signature is the one declaration of its options."""
    hints = typing.get_type_hints(fn, include_extras=True)
    params = inspect.signature(fn).parameters
    names = include if include is not None else tuple(params)
    out = {}
    for n in names:
        if n in exclude:
            continue
        p = params[n]
        default = PydanticUndefined if p.default is inspect.Parameter.empty else p.default
        out[n] = FieldInfo.from_annotated_attribute(hints.get(n, Any), default)
    return out


def generation_options(*, exclude: tuple[str, ...] = (), **defaults) -> Callable:
    """Options for every ``BatchOptions`` field (generation settings and retries), into ``generation``."""
    fields = {**GenerationSettings.model_fields, **BatchOptions.model_fields}
    return field_options({n: f for n, f in fields.items() if n not in exclude}, "generation", **defaults)


def press_options(**defaults) -> Callable:
    """Options for the press settings, each a comma-separated list, into ``press``; ``--press-param
    NAME=VALUE`` (repeatable) sets the method's own parameters."""
    params = []
    for n, f in PressSettings.model_fields.items():
        if n == "press_params":
            continue
        default = defaults.get(n, f.default)
        params.append(_option(n, Optional[str], None if default is None else str(default),
                              _help(n, f, " (comma-separated: every combination runs)")))
    params.append(inspect.Parameter(
        "press_param", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[list[str]],
        default=typer.Option(None, "--press-param", "--press_param",
                             help="the method's own parameter as NAME=VALUE (JSON value), repeatable; "
                                  "e.g. tau=0.5 or scales=[true,false,false]")))
    return lambda fn: _add(fn, "press", params, fields=dict(PressSettings.model_fields),
                           overridden=tuple(defaults))
