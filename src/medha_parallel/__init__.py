"""medha_parallel: TP, stream-pipeline (SPP) and KV-cache (KVP) parallelism on torch.distributed."""

from medha_parallel.errors import CommunicationError as CommunicationError
from medha_parallel.layout import Coords as Coords
from medha_parallel.layout import ParallelLayout as ParallelLayout
from medha_parallel.state import ParallelState as ParallelState
