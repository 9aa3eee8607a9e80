"""What the GPU ran at while a timing ran: SM clock, power, temperature, and why it was held back.

An H100 running attention at full rate hits its 700 W power limit: the driver then lowers the SM
clock (1.3-1.8 GHz at the long cells of this project's sweeps, up to 1.965 at the short ones;
docs/k6.md, "The power limit"), and a warmer chip leaks more and gets less. Two timings of one kernel minutes apart can differ by several percent for that
reason alone, so each timing records the state it ran in. NVML is read through ctypes (no extra
package); a background thread samples it every ``period_s`` and a timing asks for the samples
inside its own window. Without NVML (a CPU machine, a driver without it) every answer is None.
"""

from __future__ import annotations

import ctypes
import os
import statistics
import threading
import time

# nvmlDeviceGetCurrentClocksEventReasons bits (nvml.h), the ones that lower the clock under load
EVENT_REASONS = {0x4: "power_cap", 0x8: "hw_slowdown", 0x20: "sw_thermal", 0x40: "hw_thermal",
                 0x80: "hw_power_brake"}
NVML_CLOCK_SM = 1
NVML_TEMPERATURE_GPU = 0


def reasons(mask: int) -> list:
    """Names of the clock-lowering reasons set in an NVML event-reason mask."""
    return [name for bit, name in EVENT_REASONS.items() if mask & bit]


def summarize(samples: list) -> dict | None:
    """Median SM clock (MHz) and power (W), the highest temperature (C), and every clock-lowering
    reason seen, of (clock, power, temp, reason mask) samples; None without samples."""
    if not samples:
        return None
    mask = 0
    for s in samples:
        mask |= s[3]
    return dict(sm_clock_mhz=statistics.median(s[0] for s in samples),
                power_w=round(statistics.median(s[1] for s in samples), 1),
                temp_c=max(s[2] for s in samples), clock_limited_by=reasons(mask), samples=len(samples))


def _visible_index(cuda_index: int) -> int:
    """NVML counts every GPU; CUDA only the visible ones, in CUDA_VISIBLE_DEVICES order."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    try:
        return int(visible[cuda_index])
    except (ValueError, IndexError):
        return cuda_index


class Sampler:
    """NVML readings of one GPU, every ``period_s`` seconds, on a daemon thread."""

    def __init__(self, cuda_index: int = 0, period_s: float = 0.02):
        self.period_s = period_s
        self.samples = []  # (monotonic time, clock MHz, power W, temp C, reason mask)
        self.lock = threading.Lock()
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        if nvml.nvmlInit_v2() != 0:
            raise OSError("nvmlInit failed")
        self.handle = ctypes.c_void_p()
        if nvml.nvmlDeviceGetHandleByIndex_v2(_visible_index(cuda_index), ctypes.byref(self.handle)) != 0:
            raise OSError("no NVML handle for the GPU")
        self.nvml = nvml
        self.event_reasons = (getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
                              or nvml.nvmlDeviceGetCurrentClocksThrottleReasons)  # its name before 2023
        self.read()  # fail here, not on the thread, if a query is unsupported
        threading.Thread(target=self.run, daemon=True).start()

    def read(self) -> tuple:
        clock, power, temp, mask = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint(), ctypes.c_ulonglong()
        for rc in (self.nvml.nvmlDeviceGetClockInfo(self.handle, NVML_CLOCK_SM, ctypes.byref(clock)),
                   self.nvml.nvmlDeviceGetPowerUsage(self.handle, ctypes.byref(power)),
                   self.nvml.nvmlDeviceGetTemperature(self.handle, NVML_TEMPERATURE_GPU, ctypes.byref(temp)),
                   self.event_reasons(self.handle, ctypes.byref(mask))):
            if rc != 0:
                raise OSError(f"NVML query failed ({rc})")
        return clock.value, power.value / 1000.0, temp.value, mask.value

    def run(self) -> None:
        while True:
            try:
                s = (time.monotonic(), *self.read())
            except OSError:
                return
            with self.lock:
                self.samples.append(s)
                if len(self.samples) > 100_000:
                    del self.samples[:50_000]
            time.sleep(self.period_s)

    def window(self, t0: float, t1: float) -> dict | None:
        with self.lock:
            inside = [s[1:] for s in self.samples if t0 <= s[0] <= t1]
        return summarize(inside)


_sampler = None


def sampler():
    """The process's sampler for the current CUDA device, started on first use; None without NVML."""
    global _sampler
    if _sampler is None:
        try:
            import torch

            _sampler = Sampler(torch.cuda.current_device())
        except Exception:  # no CUDA (a CPU build of torch), no NVML library, a query it lacks
            _sampler = False
    return _sampler or None
