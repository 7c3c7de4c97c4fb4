"""`jaxspec.aot.gpu_devices(device_memory=)`: the per-device memory a program is compiled for.

(That `depth_cost` equals a direct compile is checked at real widths by
`benchmarks/projection.py --validate`: a GPU compile of even the tiny V3.2 spills registers or
finds no Triton tiles, and a real-width one takes tens of seconds.)
"""

from __future__ import annotations

import pytest

from jaxspec import aot


def test_device_memory_must_be_positive():
    with pytest.raises(ValueError, match=r"device_memory=0: must be >= 1"):
        aot.gpu_devices("h100", device_memory=0)
