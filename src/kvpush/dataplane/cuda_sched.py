"""How this process's CUDA context waits for the GPU: spin, yield or block (CUDA's scheduling flags).

Why: by default (`CU_CTX_SCHED_AUTO` with fewer contexts than cores) a thread that synchronizes on the GPU spins
inside the driver until the work is done. A vLLM engine's forward thread does so for most of a long prefill (it
waits on the step's output event while the GPU runs the forward), and every other thread of the process that
calls CUDA meanwhile (the data plane's I/O thread, and through NIXL UCX's `cuda_ipc` copies and event queries)
competes with that spinning waiter. `cuda_sync_mode` sets the flags on the process's current context, through
the driver API (`cuCtxSetFlags`, CUDA 12.1+), once, from the thread that registers the KV caches.
"""

from __future__ import annotations

import ctypes
from typing import Final

from kvpush.observability import get_logger

_log = get_logger("dataplane.cuda_sched")

SYNC_MODES: Final[dict[str, int]] = {
    "auto": 0x0,  # CU_CTX_SCHED_AUTO
    "spin": 0x1,  # CU_CTX_SCHED_SPIN
    "yield": 0x2,  # CU_CTX_SCHED_YIELD
    "blocking": 0x4,  # CU_CTX_SCHED_BLOCKING_SYNC
}
_SCHED_MASK: Final = 0x7


class CudaSchedError(RuntimeError):
    """The driver refused to read or set the context's flags."""


def _driver() -> ctypes.CDLL:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise CudaSchedError(f"the CUDA driver library is not loadable: {exc}") from exc


def _check(result: int, call: str) -> None:
    if result != 0:
        raise CudaSchedError(f"{call} returned CUresult {result}")


def current_sync_mode() -> str:
    """The scheduling mode of the calling thread's current context ("auto", "spin", "yield" or "blocking")."""
    flags = ctypes.c_uint(0)
    _check(_driver().cuCtxGetFlags(ctypes.byref(flags)), "cuCtxGetFlags")
    sched = flags.value & _SCHED_MASK
    return next((name for name, bits in SYNC_MODES.items() if bits == sched), f"0x{sched:x}")


def set_sync_mode(mode: str) -> str:
    """Set the calling thread's current context to `mode`, keeping its other flags; returns the mode read back.

    The thread must have the context current (a vLLM worker's thread has, once it has touched the GPU).
    """
    if mode not in SYNC_MODES:
        raise ValueError(f"cuda_sync_mode must be one of {sorted(SYNC_MODES)}, not {mode!r}")
    lib = _driver()
    context = ctypes.c_void_p(0)
    _check(lib.cuCtxGetCurrent(ctypes.byref(context)), "cuCtxGetCurrent")
    if not context.value:
        raise CudaSchedError("no CUDA context is current on this thread")
    flags = ctypes.c_uint(0)
    _check(lib.cuCtxGetFlags(ctypes.byref(flags)), "cuCtxGetFlags")
    before = flags.value
    _check(lib.cuCtxSetFlags(ctypes.c_uint((before & ~_SCHED_MASK) | SYNC_MODES[mode])), "cuCtxSetFlags")
    applied = current_sync_mode()
    _log.info("cuda_sync_mode_set", requested=mode, previous_flags=before, applied=applied)
    return applied
