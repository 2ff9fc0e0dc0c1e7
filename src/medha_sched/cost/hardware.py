"""Accelerator specifications for the roofline cost model, with presets.

The presets use public datasheet peaks (dense bf16, HBM, NVLink per GPU per
direction) and fixed achievable-efficiency factors; they are starting points,
not measurements.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from medha_sched.config import _check_float
from medha_sched.cost.presets import lookup_preset


@dataclass(frozen=True, kw_only=True, slots=True)
class HardwareSpec:
    """One GPU's peak rates and the fraction of them kernels achieve.

    Attributes:
        name: label for messages.
        peak_flops: dense bf16 FLOP/s.
        hbm_bandwidth: HBM bytes/s.
        interconnect_bandwidth: intra-node bytes/s per GPU per direction.
        kernel_overhead: seconds of fixed cost per kernel launch or collective.
        compute_efficiency: achievable fraction of ``peak_flops``, in (0, 1].
        memory_efficiency: achievable fraction of ``hbm_bandwidth``, in (0, 1].
    """

    name: str = "custom"
    peak_flops: float
    hbm_bandwidth: float
    interconnect_bandwidth: float
    kernel_overhead: float = 3e-6
    compute_efficiency: float = 0.7
    memory_efficiency: float = 0.8

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty string, got {self.name!r}")
        for key in ("peak_flops", "hbm_bandwidth", "interconnect_bandwidth"):
            _check_float(key, getattr(self, key), minimum=0.0, strict=True)
        _check_float("kernel_overhead", self.kernel_overhead, minimum=0.0)
        for key in ("compute_efficiency", "memory_efficiency"):
            value = getattr(self, key)
            _check_float(key, value, minimum=0.0, strict=True)
            if value > 1.0:
                raise ValueError(f"{key} must be <= 1, got {value!r}")

    @property
    def flops_rate(self) -> float:
        """Achievable FLOP/s."""
        return self.peak_flops * self.compute_efficiency

    @property
    def memory_rate(self) -> float:
        """Achievable HBM bytes/s."""
        return self.hbm_bandwidth * self.memory_efficiency


#: presets by name: A100-80GB SXM, H100 SXM, H200 SXM
HARDWARE_PRESETS: Mapping[str, HardwareSpec] = MappingProxyType(
    {
        "a100": HardwareSpec(
            name="a100", peak_flops=312e12, hbm_bandwidth=2.039e12, interconnect_bandwidth=300e9
        ),
        "h100": HardwareSpec(
            name="h100", peak_flops=989e12, hbm_bandwidth=3.35e12, interconnect_bandwidth=450e9
        ),
        "h200": HardwareSpec(
            name="h200", peak_flops=989e12, hbm_bandwidth=4.8e12, interconnect_bandwidth=450e9
        ),
    }
)


def get_hardware(name: str) -> HardwareSpec:
    """The preset called ``name`` (``a100``, ``h100``, ``h200``)."""
    return lookup_preset(HARDWARE_PRESETS, name, "GPU")
