"""A background sampler of CPU, memory and (through NVML) GPU readings during a run."""

from __future__ import annotations

import logging
import threading
import time

import psutil

from engine.results import TelemetrySample

log = logging.getLogger(__name__)


class _Nvml:
    """NVML handle for GPU 0, or None where no NVIDIA GPU or driver is present."""

    def __init__(self) -> None:
        self.handle = None
        self.error: str | None = None  # why there are no GPU readings, where a GPU exists
        try:
            import pynvml  # from nvidia-ml-py

            pynvml.nvmlInit()
            if pynvml.nvmlDeviceGetCount() > 0:
                self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
                self.nvml = pynvml
        except Exception as e:  # no driver, no library, no device: all mean "no GPU readings"
            import torch

            if torch.cuda.is_available():  # a GPU without NVML: say so, and results record why
                self.error = f"{type(e).__name__}: {e}"
                log.warning("NVML unavailable on a machine with CUDA (%s): no GPU telemetry", self.error)
            else:
                log.debug("NVML unavailable: %s", e)

    def read(self) -> tuple[float | None, int | None, float | None]:
        if self.handle is None:
            return None, None, None
        n = self.nvml
        try:
            util = float(n.nvmlDeviceGetUtilizationRates(self.handle).gpu)
            mem = int(n.nvmlDeviceGetMemoryInfo(self.handle).used)
            power = n.nvmlDeviceGetPowerUsage(self.handle) / 1000.0
            return util, mem, power
        except Exception as e:
            log.debug("NVML read failed: %s", e)
            return None, None, None


class TelemetrySampler:
    """Samples every ``interval_s`` on a daemon thread between ``start()`` and ``stop()``."""

    def __init__(self, interval_s: float = 0.25):
        self.interval_s = interval_s
        self.samples: list[TelemetrySample] = []
        self._proc = psutil.Process()
        self._nvml = _Nvml()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    @property
    def has_gpu(self) -> bool:
        return self._nvml.handle is not None

    @property
    def gpu_error(self) -> str | None:
        """Why a machine with CUDA has no GPU readings (None where they work or there is no GPU)."""
        return self._nvml.error

    def start(self, t0: float | None = None) -> TelemetrySampler:
        self._t0 = time.perf_counter() if t0 is None else t0
        self._proc.cpu_percent(None)  # prime: the first reading is relative to this call
        self._thread = threading.Thread(target=self._loop, name="moetune-telemetry", daemon=True)
        self._thread.start()
        return self

    def sample(self) -> TelemetrySample:
        util, mem, power = self._nvml.read()
        s = TelemetrySample(t_s=time.perf_counter() - self._t0, cpu_percent=self._proc.cpu_percent(None),
                            rss_bytes=self._proc.memory_info().rss, gpu_util_percent=util, gpu_mem_bytes=mem,
                            gpu_power_w=power)
        self.samples.append(s)
        return s

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def stop(self) -> list[TelemetrySample]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()
        return self.samples

    def peak_rss_bytes(self) -> int:
        return max((s.rss_bytes for s in self.samples), default=self._proc.memory_info().rss)
