"""Oracles for the incremental scheduler (issue 20).

``ReferenceScheduler`` is the algorithm of issue 2, kept verbatim; with
``queue=ResortQueue`` it re-sorts the whole prefill queue at every step, as
vidur does.
"""

from .resort_queue import ResortQueue as ResortQueue
from .scheduler import ReferenceScheduler as ReferenceScheduler
