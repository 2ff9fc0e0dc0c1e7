"""medha_sched: pure-Python scheduling for long-context LLM inference.

The pieces are usable one at a time: a policy from the registry, a cost
model, the prefill-time cache, the KV block manager, or the whole
:class:`Scheduler`, which turns requests into plain-data batches.

>>> from medha_sched import AffineCostModel, Request, Scheduler, SchedulerConfig
>>> sched = Scheduler(
...     SchedulerConfig(policy="lars", target_batch_time=0.05),
...     AffineCostModel(base=2e-3, per_token=2e-5, per_attn=1e-9),
... )
>>> sched.add_request(Request("a", 0.0, 100, 8))
>>> [(c.request_id, c.num_tokens) for c in sched.schedule(0.0).chunks]
[('a', 100)]
"""

from medha_sched.chunking import largest_fitting_chunk as largest_fitting_chunk
from medha_sched.config import CacheConfig as CacheConfig
from medha_sched.config import ParallelDegrees as ParallelDegrees
from medha_sched.config import SchedulerConfig as SchedulerConfig
from medha_sched.cost import AffineCostModel as AffineCostModel
from medha_sched.cost import AggregateCostModel as AggregateCostModel
from medha_sched.cost import BatchWork as BatchWork
from medha_sched.cost import CostModel as CostModel
from medha_sched.cost import RequestWork as RequestWork
from medha_sched.cost import RooflineCostModel as RooflineCostModel
from medha_sched.cost import TableCostModel as TableCostModel
from medha_sched.cost import parse_cost_model_spec as parse_cost_model_spec
from medha_sched.errors import RequestTooLongError as RequestTooLongError
from medha_sched.errors import SchedulerError as SchedulerError
from medha_sched.kv_memory import KVBlockManager as KVBlockManager
from medha_sched.output import PENDING_TOKEN as PENDING_TOKEN
from medha_sched.output import BatchResult as BatchResult
from medha_sched.output import ScheduledChunk as ScheduledChunk
from medha_sched.output import ScheduleOutput as ScheduleOutput
from medha_sched.policies import available_policies as available_policies
from medha_sched.policies import get_policy as get_policy
from medha_sched.policies import register_policy as register_policy
from medha_sched.prefill_cache import PrefillTimeCache as PrefillTimeCache
from medha_sched.priority_index import KineticIndex as KineticIndex
from medha_sched.request import Request as Request
from medha_sched.request import RequestStatus as RequestStatus
from medha_sched.scheduler import Scheduler as Scheduler

__version__ = "0.1.0"
