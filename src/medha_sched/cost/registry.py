"""Cost models by name: built-ins, run-time registrations and plug-ins.

A *spec string* names a model and its parameters::

    NAME                        no parameters
    NAME:key=value,key=value    parameters, passed as a ``str -> str`` mapping
    NAME:ARG                    a bare argument is shorthand for ``path=ARG``

for example ``affine:base=0.004,per_token=4e-5,per_attn=7e-10``,
``roofline:model=llama3-8b,gpu=h100`` or ``table:profile.json``. An argument
counts as bare when it has no ``=`` or does not start with an identifier
followed by ``=``, so most file paths need no ``path=``.

Names resolve in this order: models registered with
:func:`register_cost_model`; the built-ins ``affine``, ``roofline``,
``table`` and ``online`` (imported on first use); then the entry-point group
``medha.cost_models``, read through :mod:`importlib.metadata` only for a name
not found earlier. An entry point's object is a class with a classmethod
``from_spec(params: Mapping[str, str], *, layout: ParallelDegrees)``.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Mapping, Sequence
from importlib import metadata
from types import MappingProxyType

from medha_sched.config import ParallelDegrees
from medha_sched.cost.base import CostModel

#: the entry-point group third-party cost models register under
ENTRY_POINT_GROUP = "medha.cost_models"

#: the layout used when none is given: one GPU
DEFAULT_LAYOUT = ParallelDegrees()

#: ``factory(params, layout=layout) -> CostModel``
CostModelFactory = Callable[..., CostModel]

_BUILTINS = {
    "affine": "medha_sched.cost.affine:AffineCostModel",
    "roofline": "medha_sched.cost.roofline:RooflineCostModel",
    "table": "medha_sched.cost.table:TableCostModel",
    "online": "medha_sched.cost.online:OnlineCostModel",
}
_registry: dict[str, CostModelFactory] = {}
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*\Z")
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def register_cost_model(name: str, factory: object, *, replace: bool = False) -> None:
    """Make ``name`` resolve to ``factory``.

    ``factory`` is a class with a ``from_spec(params, *, layout)`` classmethod,
    or a callable with that signature. Registering a taken name (a built-in
    included) needs ``replace=True``.
    """
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"cost model name must match {_NAME.pattern!r}, got {name!r}")
    fn = _as_factory(name, factory)
    if not replace and (name in _registry or name in _BUILTINS):
        raise ValueError(f"cost model {name!r} is already registered; pass replace=True")
    _registry[name] = fn


def available_cost_models() -> list[str]:
    """Sorted names of every resolvable model (plug-ins are listed, not loaded)."""
    names = set(_BUILTINS) | set(_registry)
    names.update(ep.name for ep in _entry_points())
    return sorted(names)


def create_cost_model(
    name: str, params: Mapping[str, str], *, layout: ParallelDegrees = DEFAULT_LAYOUT
) -> CostModel:
    """Build the model registered as ``name`` from string parameters."""
    factory = _resolve(name, where="")
    if not isinstance(layout, ParallelDegrees):
        raise ValueError(f"layout must be a ParallelDegrees, got {layout!r}")
    for key, value in params.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise ValueError(f"cost model parameters must map str to str, got {key!r}: {value!r}")
    model = factory(MappingProxyType(dict(params)), layout=layout)
    if not isinstance(model, CostModel):
        raise ValueError(f"cost model {name!r} built {model!r}, which is not a CostModel")
    return model


def parse_cost_model_spec(spec: str, *, layout: ParallelDegrees = DEFAULT_LAYOUT) -> CostModel:
    """Build a model from a spec string such as ``roofline:model=llama3-8b,gpu=h100``."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"cost model spec must be a non-empty string, got {spec!r}")
    name, _, args = spec.strip().partition(":")
    name = name.strip()
    if not name:
        raise ValueError(f"cost model spec {spec!r} has no model name before ':'")
    params = _parse_args(spec, args)
    _resolve(name, where=f" in spec {spec!r}")
    try:
        return create_cost_model(name, params, layout=layout)
    except ValueError as exc:
        raise ValueError(f"invalid cost model spec {spec!r}: {exc}") from exc


def check_spec_keys(
    model: str,
    params: Mapping[str, str],
    *,
    required: Sequence[str] = (),
    optional: Sequence[str] = (),
) -> None:
    """Reject keys a model does not know and report the first missing one."""
    known = sorted({*required, *optional})
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise ValueError(
            f"unknown key {unknown[0]!r} for cost model {model!r}; known: {', '.join(known)}"
        )
    for key in required:
        if key not in params:
            raise ValueError(f"cost model {model!r} needs key {key!r}; required: {required}")


def spec_float(model: str, params: Mapping[str, str], key: str) -> float:
    """``params[key]`` as a float; the error names the model, key and value."""
    raw = params[key]
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"cost model {model!r}: {key}={raw!r} is not a number") from None


#: keys whose value is itself a cost model spec: it runs to the end of the spec
NESTED_SPEC_KEYS = frozenset({"prior"})


def _parse_args(spec: str, args: str) -> dict[str, str]:
    args = args.strip()
    if not args:
        return {}
    head = args.split("=", 1)[0].strip()
    if "=" not in args or not _KEY.match(head):
        return {"path": args}
    params: dict[str, str] = {}
    rest = args
    while rest:
        item, _, rest = rest.partition(",")
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not _KEY.match(key):
            raise ValueError(f"malformed item {item!r} in cost model spec {spec!r}; want key=value")
        if key in params:
            raise ValueError(f"duplicate key {key!r} in cost model spec {spec!r}")
        if key in NESTED_SPEC_KEYS and rest:  # a whole spec of its own, commas and all
            value, rest = f"{value},{rest}", ""
        params[key] = value.strip()
    return params


def _resolve(name: str, *, where: str) -> CostModelFactory:
    found = _registry.get(name)
    if found is not None:
        return found
    if name in _BUILTINS:
        module, _, attr = _BUILTINS[name].partition(":")
        obj = getattr(importlib.import_module(module), attr)
    else:
        ep = next((e for e in _entry_points() if e.name == name), None)
        if ep is None:
            known = ", ".join(available_cost_models())
            raise ValueError(f"unknown cost model {name!r}{where}; known: {known}")
        obj = _load_entry_point(ep)
    _registry[name] = _as_factory(name, obj)
    return _registry[name]


def _load_entry_point(ep: metadata.EntryPoint) -> object:
    try:
        return ep.load()
    except Exception as exc:  # a broken plug-in must not look like a missing one
        raise ValueError(
            f"cannot load cost model {ep.name!r} from entry point {ep.value!r}: {exc}"
        ) from exc


def _entry_points() -> Sequence[metadata.EntryPoint]:
    return tuple(metadata.entry_points(group=ENTRY_POINT_GROUP))


def _as_factory(name: str, obj: object) -> CostModelFactory:
    from_spec = getattr(obj, "from_spec", None)
    if callable(from_spec):
        return from_spec
    if callable(obj):
        return obj
    raise ValueError(f"cost model {name!r}: {obj!r} has no from_spec and is not callable")
