"""Device memory: simulated before launch (``simulation``, ``plan``) and measured during training (``measure``)."""

from project.memory.measure import DeviceMemory

__all__ = ["DeviceMemory"]
