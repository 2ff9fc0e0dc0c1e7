"""medha_parallel: TP, stream-pipeline (SPP) and KV-cache (KVP) parallelism on torch.distributed."""

from medha_parallel.errors import CommunicationError as CommunicationError
from medha_parallel.layout import Coords as Coords
from medha_parallel.layout import ParallelLayout as ParallelLayout
from medha_parallel.spp import SendHandle as SendHandle
from medha_parallel.spp import SPPCommunicator as SPPCommunicator
from medha_parallel.spp import SPPProtocolError as SPPProtocolError
from medha_parallel.spp import SPPStats as SPPStats
from medha_parallel.spp import StageRunner as StageRunner
from medha_parallel.spp_header import ChunkHeaderError as ChunkHeaderError
from medha_parallel.spp_header import ChunkMeta as ChunkMeta
from medha_parallel.spp_header import MicroBatch as MicroBatch
from medha_parallel.state import ParallelState as ParallelState

# isort: split
from medha_parallel.kvp import KVPCommunicator as KVPCommunicator
from medha_parallel.kvp import kvp_attention as kvp_attention
from medha_parallel.linear import ColumnParallelLinear as ColumnParallelLinear
from medha_parallel.linear import RowParallelLinear as RowParallelLinear
from medha_parallel.merge import merge_partials as merge_partials
from medha_parallel.tokens import TokenBroadcast as TokenBroadcast
from medha_parallel.tokens import TokenReturn as TokenReturn
from medha_parallel.tp import TPCommunicator as TPCommunicator
