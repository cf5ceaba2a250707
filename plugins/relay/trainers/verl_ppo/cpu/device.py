"""`torch.cpu` with what verl asks of a device module (`verl.utils.device.get_torch_device()`).

verl calls its platform's device module as it calls `torch.cuda`: `empty_cache()` after every phase,
`synchronize()`, `get_rng_state()` / `set_rng_state()` in its checkpoints, the memory counters in its
logs. `torch.cpu` has some of these and lacks the rest; here the missing ones do what they mean on a
CPU: there is no cache to empty, nothing reserved beyond what the process holds, one device.
Everything else is `torch.cpu`'s own (module `__getattr__`).
"""

from __future__ import annotations

from typing import Any

import psutil
import torch


def empty_cache() -> None:
    """Nothing to release: the CPU allocator keeps no device cache."""


def ipc_collect() -> None:
    """Nothing to collect: no CUDA IPC handles on a CPU."""


def synchronize(device: Any = None) -> None:
    """CPU kernels are done when they return."""


def current_device() -> int:
    return 0


def device_count() -> int:
    return 1


def set_device(device: Any) -> None:
    """One device: nothing to select."""


def is_available() -> bool:
    return True


def get_device_name(device: Any = None) -> str:
    return "cpu"


def get_rng_state(device: Any = None) -> torch.Tensor:
    """The CPU generator's state: on a CPU the device generator is torch's default one."""
    return torch.get_rng_state()


def set_rng_state(state: torch.Tensor, device: Any = None) -> None:
    torch.set_rng_state(state)


def manual_seed(seed: int) -> None:
    torch.manual_seed(seed)


def manual_seed_all(seed: int) -> None:
    torch.manual_seed(seed)


def _resident() -> int:
    return psutil.Process().memory_info().rss


def memory_allocated(device: Any = None) -> int:
    return _resident()


def memory_reserved(device: Any = None) -> int:
    return _resident()


def max_memory_allocated(device: Any = None) -> int:
    return _resident()


def max_memory_reserved(device: Any = None) -> int:
    return _resident()


def reset_peak_memory_stats(device: Any = None) -> None:
    """Peaks are the process's resident size now: nothing to reset."""


def mem_get_info(device: Any = None) -> tuple[int, int]:
    """(free, total) bytes of the host's memory, as torch.cuda.mem_get_info gives them for a GPU."""
    vm = psutil.virtual_memory()
    return vm.available, vm.total


def set_per_process_memory_fraction(fraction: float, device: Any = None) -> None:
    """A GPU memory cap; a CPU process has none to set."""


def __getattr__(name: str) -> Any:
    return getattr(torch.cpu, name)
