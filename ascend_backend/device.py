"""Which torch device the Ascend backend runs on.

`torch_npu` registers the "npu" device with torch when imported; it is imported here, lazily,
only when an NPU is asked for, so that the same code runs (and is tested) on torch's CPU
device where no NPU or `torch_npu` is installed.
"""

from __future__ import annotations

import importlib

import torch

DEVICES = ("cpu", "npu")


class AscendDeviceError(RuntimeError):
    """The device asked for is not available here (a name we do not know, or "npu" without
    `torch_npu` or without an NPU)."""


def torch_device(name: str = "cpu") -> torch.device:
    """"cpu" or "npu" (optionally "npu:<index>") -> the torch device, checked at start-up."""
    kind = name.split(":", 1)[0]
    if kind not in DEVICES:
        raise AscendDeviceError(f"unknown device {name!r}; the Ascend backend runs on {DEVICES}")
    if kind == "npu":
        try:
            importlib.import_module("torch_npu")
        except ImportError as err:
            raise AscendDeviceError(f"device {name!r} needs torch_npu, which is not installed "
                                    f"({err})") from err
        if not torch.npu.is_available():      # registered by torch_npu
            raise AscendDeviceError(f"device {name!r}: torch_npu finds no NPU on this machine")
    return torch.device(name)
