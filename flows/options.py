"""CLI options generated from the settings models, so ``run``, ``sweep``, ``eval`` and ``serve`` share one
declaration: each field of ``GenerationSettings`` becomes ``--field-name`` (and ``--field_name``, the
kvpress spelling), with the field's default and description; the press fields take comma-separated
lists (a batch runs every combination). A command receives them as one dict per group.
"""

from __future__ import annotations

import functools
import inspect
import typing
from typing import Any, Callable, Optional

import typer
from pydantic.fields import FieldInfo

import nestedkv
from pipeline.config import BatchOptions, GenerationSettings, PressSettings

# kvpress users' spellings work beside ours.
EXTRA_FLAGS = {"press": ["--press-name"]}


def _flags(name: str) -> list[str]:
    dashed = "--" + name.replace("_", "-")
    return [dashed] + ([f"--{name}"] if "_" in name else []) + EXTRA_FLAGS.get(name, [])


def _cli_type(field: FieldInfo) -> Any:
    ann = field.annotation
    args = [a for a in typing.get_args(ann) if a is not type(None)]
    if typing.get_origin(ann) is typing.Literal:
        return str
    if typing.get_origin(ann) is typing.Union and len(args) == 1:
        return Optional[args[0]]
    return ann


def choices(name: str, field: FieldInfo) -> tuple[str, ...]:
    """The values a setting takes, for its help: the press registry's names, or a Literal's values (an
    Optional one's too); none for free values."""
    if name == "press":
        return tuple(nestedkv.PRESSES)
    ann = field.annotation
    for a in (ann, *typing.get_args(ann)):
        if typing.get_origin(a) is typing.Literal:
            return tuple(str(v) for v in typing.get_args(a))
    return ()


def _help(name: str, field: FieldInfo, suffix: str = "") -> str:
    text, ways = field.description or "", choices(name, field)
    named = all(w in text for w in ways)  # a description that tells each choice already
    return text + suffix + ("" if named else f"; one of: {', '.join(ways)}")


def _option(name: str, annotation: Any, default: Any, help: str) -> inspect.Parameter:
    opt = typer.Option(default, *_flags(name), help=help)
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=opt, annotation=annotation)


def _add(fn: Callable, into: str, params: list[inspect.Parameter]) -> Callable:
    """``fn`` with ``params`` added to its signature; their values reach ``fn`` as one dict, ``into``."""
    sig = inspect.signature(fn)
    own = [p for p in sig.parameters.values() if p.name != into]
    names = [p.name for p in params]

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        kwargs[into] = {n: kwargs.pop(n) for n in names}
        return fn(*args, **kwargs)

    wrapper.__signature__ = sig.replace(parameters=own + params)
    hints = typing.get_type_hints(fn)
    wrapper.__annotations__ = {**{p.name: hints.get(p.name, p.annotation) for p in own},
                               **{p.name: p.annotation for p in params}}
    return wrapper


def generation_options(*, exclude: tuple[str, ...] = (), **defaults) -> Callable:
    """Options for every ``BatchOptions`` field (generation settings and retries), into ``generation``."""
    fields = {**GenerationSettings.model_fields, **BatchOptions.model_fields}
    params = [_option(n, _cli_type(f), defaults.get(n, f.default), _help(n, f))
              for n, f in fields.items() if n not in exclude]
    return lambda fn: _add(fn, "generation", params)


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
    return lambda fn: _add(fn, "press", params)
