"""The one error the checkpoint layer raises (its own module, so every submodule can import it)."""
from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as asked; the message names the file and the tensor."""


class DeviceUnavailableError(RuntimeError):
    """A read to a device this machine does not have (CUDA on a CPU-only box): not the checkpoint's fault."""
