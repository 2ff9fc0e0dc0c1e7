"""Cost models: predict one iteration's latency from plain numbers.

Built-ins: :class:`AffineCostModel` (calibrated constants),
:class:`RooflineCostModel` (analytic, from a model shape and a GPU) and
:class:`TableCostModel` (an interpolated measured profile). Build any of them,
or a plug-in, from a spec string with :func:`parse_cost_model_spec`.
"""

from medha_sched.cost.affine import AffineCostModel as AffineCostModel
from medha_sched.cost.base import AggregateCostModel as AggregateCostModel
from medha_sched.cost.base import BatchWork as BatchWork
from medha_sched.cost.base import CostModel as CostModel
from medha_sched.cost.base import RequestWork as RequestWork
from medha_sched.cost.hardware import HARDWARE_PRESETS as HARDWARE_PRESETS
from medha_sched.cost.hardware import HardwareSpec as HardwareSpec
from medha_sched.cost.hardware import get_hardware as get_hardware
from medha_sched.cost.models import MODEL_PRESETS as MODEL_PRESETS
from medha_sched.cost.models import ModelShape as ModelShape
from medha_sched.cost.models import get_model_shape as get_model_shape
from medha_sched.cost.registry import ENTRY_POINT_GROUP as ENTRY_POINT_GROUP
from medha_sched.cost.registry import available_cost_models as available_cost_models
from medha_sched.cost.registry import create_cost_model as create_cost_model
from medha_sched.cost.registry import parse_cost_model_spec as parse_cost_model_spec
from medha_sched.cost.registry import register_cost_model as register_cost_model
from medha_sched.cost.roofline import RooflineCostModel as RooflineCostModel
from medha_sched.cost.table import TableCostModel as TableCostModel
