"""The flows' parameters, generated from ``BatchSpec``: every flow that runs a batch has the spec's fields as
its parameters (the Prefect parameter schema and a deployment's ``--param`` names), and turns them back
into one ``BatchSpec``. A one-configuration flow takes each press setting as one value (``press``,
``compression_ratio``: what users change on a re-run); a sweep takes lists, under its plural names.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

from pipeline.config import PressSettings
from pipeline.spec import FIXED_FIELDS, BatchSpec

# What a flow's caller decides, not its parameters: the task is the flow's, the kind of batch is the flow's.
KIND_FIELDS = ("task", "reference", "evaluate", "metrics")


def with_signature(fn: Callable, params: list[inspect.Parameter]) -> Callable:
    """``fn`` (taking ``**kwargs``) as a function with exactly ``params``: what typer and Prefect read."""
    fn.__signature__ = inspect.Signature(params)
    fn.__annotations__ = {p.name: p.annotation for p in params}
    return fn


class SpecParameters:
    """``BatchSpec``'s fields as one flow's parameters. ``one``: the press settings are single values;
    ``rename``: spec field -> parameter name; ``defaults``: parameter name -> default."""

    def __init__(self, one: bool, rename: Optional[dict] = None, defaults: Optional[dict] = None,
                 exclude: tuple[str, ...] = KIND_FIELDS):
        self.one, self.rename, self.defaults = one, rename or {}, defaults or {}
        fields = [n for n in BatchSpec.model_fields if n not in exclude]
        self.fields = ["input", *(n for n in fields if n != "input")]  # the input first, as a reader looks for it

    def name(self, field: str) -> str:
        return self.rename.get(field, field)

    def _annotation(self, field: str) -> Any:
        if field in FIXED_FIELDS:  # press_params: None is none
            return Optional[BatchSpec.model_fields[field].annotation]
        if self.one and field in PressSettings.model_fields:
            return PressSettings.model_fields[field].annotation
        return BatchSpec.model_fields[field].annotation

    def _default(self, field: str) -> Any:
        name = self.name(field)
        if name in self.defaults:
            return self.defaults[name]
        if self.one and field in PressSettings.model_fields:
            return None if field in FIXED_FIELDS else PressSettings.model_fields[field].default
        return BatchSpec.model_fields[field].get_default(call_default_factory=True)

    def parameters(self) -> list[inspect.Parameter]:
        return [inspect.Parameter(self.name(f), inspect.Parameter.KEYWORD_ONLY, default=self._default(f),
                                  annotation=self._annotation(f)) for f in self.fields]

    def spec(self, kwargs: dict, **kind) -> BatchSpec:
        """The spec a flow run's parameters describe (``kind``: task, reference, evaluate, metrics)."""
        return BatchSpec(**{f: kwargs[self.name(f)] for f in self.fields if self.name(f) in kwargs}, **kind)

    def arguments(self, spec: BatchSpec) -> dict:
        """The parameters that describe ``spec`` (its one configuration's values, when ``one``)."""
        values = {**spec.model_dump(include=set(self.fields)), "options": spec.options}
        if self.one:
            values.update(spec.press_values())
        return {self.name(f): values[f] for f in self.fields}


ONE = SpecParameters(one=True)
SWEEP = SpecParameters(one=False, rename={"press": "presses", "compression_ratio": "compression_ratios",
                                          "budget": "budgets", "head_budget": "head_budgets",
                                          "prefill": "prefills", "kv_group_size": "kv_group_sizes"},
                       defaults={"presses": ["nestedkv", "keydiff"], "compression_ratios": [0.5, 0.75, 0.9],
                                 "reference": True, "evaluate": True},
                       exclude=("task", "metrics"))


def spec_function(name: str, doc: str, params: SpecParameters, body: Callable[..., Any],
                  before: tuple[inspect.Parameter, ...] = (), after: tuple[inspect.Parameter, ...] = ()) -> Callable:
    """A function named ``name`` whose parameters are ``before``, the spec's, then ``after``; it calls
    ``body(spec_kwargs, **others)`` (deployments import a flow by module path and function name)."""
    own = {p.name for p in before + after}

    def fn(**kwargs):
        return body({k: v for k, v in kwargs.items() if k not in own}, **{k: kwargs[k] for k in own if k in kwargs})

    fn.__name__ = fn.__qualname__ = name
    fn.__module__ = body.__module__  # a deployment's entrypoint: <module of the flow>.<name>
    fn.__doc__ = doc
    return with_signature(fn, [*before, *params.parameters(), *after])


def hooks_parameter() -> inspect.Parameter:
    # In-process progress callbacks (the CLI's bars); never a deployment parameter.
    return inspect.Parameter("hooks", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Optional[Any])


def keyword(name: str, annotation: Any, default: Any = inspect.Parameter.empty) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)

