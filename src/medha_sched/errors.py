"""Exceptions raised by medha_sched."""

from __future__ import annotations


class SchedulerError(ValueError):
    """Bad input to the scheduler: the message names the offending value."""


class RequestTooLongError(SchedulerError):
    """A request can never fit in the KV cache or the model's context."""
