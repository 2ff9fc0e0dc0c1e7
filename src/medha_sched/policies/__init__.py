"""Scheduling policies, selected by name from a registry."""

from __future__ import annotations

from medha_sched.policies.base import Policy as Policy
from medha_sched.policies.base import relative_slack as relative_slack
from medha_sched.policies.base import slack as slack
from medha_sched.policies.edf import EDFPolicy as EDFPolicy
from medha_sched.policies.fcfs import FCFSPolicy as FCFSPolicy
from medha_sched.policies.lars import LARSMultiPrefillPolicy as LARSMultiPrefillPolicy
from medha_sched.policies.lars import LARSPolicy as LARSPolicy
from medha_sched.policies.lrs import LRSPolicy as LRSPolicy
from medha_sched.policies.srpt import SRPTPolicy as SRPTPolicy

_REGISTRY: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (FCFSPolicy, EDFPolicy, LRSPolicy, LARSPolicy, LARSMultiPrefillPolicy, SRPTPolicy)
}


def register_policy(cls: type[Policy]) -> type[Policy]:
    """Add a policy class under ``cls.name`` (usable as a decorator)."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"a policy named {cls.name!r} is already registered")
    _REGISTRY[cls.name] = cls
    return cls


def available_policies() -> list[str]:
    return sorted(_REGISTRY)


def get_policy(name: str) -> Policy:
    """A new instance of the policy registered as ``name``."""
    try:
        return _REGISTRY[name]()
    except KeyError:
        raise ValueError(
            f"unknown policy {name!r}; known: {', '.join(available_policies())}"
        ) from None
