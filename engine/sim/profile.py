"""Hardware profiles: what the simulator knows of a machine, as a validated JSON file.

A profile describes a host (CPU and memory), optionally one accelerator, the link between them and,
for expert parallelism, the interconnect between accelerators. Two kinds exist:

- measured: ``engine calibrate --out profile.json`` times this machine's own operations and stores
  them as tables (seconds against tokens, batch and context) beside the fitted limits;
  ``calibrated: true``;
- datasheet: built-in profiles of machines that are not here (``builtin:rtx4090``, ``builtin:h100-pcie``,
  ...), from vendors' published bandwidths and peak rates with assumed efficiencies;
  ``calibrated: false``, and every result that uses one says so.

Every field is checked on load; a bad one is a one-line :class:`ProfileError` naming the file, the
field and the value. Pure data: no torch here.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROFILE_FORMAT = "moetune-profile"
PROFILE_VERSION = 1
PRECISIONS = ("fp32", "bf16", "fp16", "int8", "int4")
#: Bytes per weight of each precision (int4: half a byte; group scales are counted by the cost model).
WEIGHT_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "int8": 1.0, "int4": 0.5}


class ProfileError(ValueError):
    """A profile that cannot be used; one line naming the file, the field and the value."""


def _num(where: str, value: Any, *, positive: bool = True, lo: float | None = None, hi: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ProfileError(f"{where}={value!r}: expected a finite number")
    v = float(value)
    if positive and v <= 0:
        raise ProfileError(f"{where}={value!r}: must be > 0")
    if not positive and v < 0:
        raise ProfileError(f"{where}={value!r}: must be >= 0")
    if lo is not None and v < lo or hi is not None and v > hi:
        raise ProfileError(f"{where}={value!r}: must be within [{lo}, {hi}]")
    return v


def _obj(where: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ProfileError(f"{where}={value!r}: expected an object")
    return value


def _known(where: str, data: dict[str, Any], allowed: set[str]) -> None:
    for k in data:
        if k not in allowed:
            raise ProfileError(f"{where}: unknown field '{k}' (value {data[k]!r}); known: {', '.join(sorted(allowed))}")


@dataclass(frozen=True)
class Table:
    """Measured seconds at points ``x`` (tokens, batch, ...), interpolated linearly in log-log space and
    extrapolated along the last segment's slope (a roofline takes over beyond that in the cost model)."""

    x: tuple[float, ...]
    seconds: tuple[float, ...]
    shape: dict[str, int] = field(default_factory=dict)  # the operation's sizes at measurement

    def at(self, x: float) -> float:
        xs, ys = self.x, self.seconds
        if len(xs) == 1 or x <= xs[0]:
            return ys[0]  # at and below the first point the fixed cost dominates
        i = len(xs) - 2 if x >= xs[-1] else next(j for j in range(len(xs) - 1) if xs[j] <= x <= xs[j + 1])
        x0, x1 = math.log(xs[i]), math.log(xs[i + 1])
        y0, y1 = math.log(ys[i]), math.log(ys[i + 1])
        return math.exp(y0 + (math.log(x) - x0) / (x1 - x0) * (y1 - y0))

    def to_dict(self) -> dict[str, Any]:
        return {"x": list(self.x), "seconds": list(self.seconds), "shape": dict(self.shape)}

    @classmethod
    def parse(cls, where: str, data: Any) -> Table:
        d = _obj(where, data)
        _known(where, d, {"x", "seconds", "shape"})
        xs, ys = d.get("x"), d.get("seconds")
        if not isinstance(xs, list) or not isinstance(ys, list) or not xs or len(xs) != len(ys):
            raise ProfileError(f"{where}: 'x' and 'seconds' must be lists of the same non-zero length")
        x = tuple(_num(f"{where}.x[{i}]", v) for i, v in enumerate(xs))
        if any(b <= a for a, b in zip(x, x[1:], strict=False)):
            raise ProfileError(f"{where}.x={xs!r}: must be strictly increasing")
        y = tuple(_num(f"{where}.seconds[{i}]", v) for i, v in enumerate(ys))
        shape = {str(k): int(_num(f"{where}.shape.{k}", v)) for k, v in _obj(f"{where}.shape", d.get("shape", {})).items()}
        return cls(x, y, shape)


@dataclass(frozen=True)
class Processor:
    """A host CPU or an accelerator: memory, bandwidth, peak rates and, where measured, tables."""

    name: str
    mem_bytes: float
    mem_bw_bytes_per_s: float
    peak_flops: dict[str, float]  # per precision, all cores / SMs
    bw_efficiency: float  # achieved share of the bandwidth on streaming products
    compute_efficiency: float  # achieved share of the peak on large products
    layer_overhead_s: float  # fixed cost of one decoder layer's dispatch (Python, kernel launches)
    step_overhead_s: float  # fixed cost of one forward step (scheduling, sampling)
    cores: int = 0  # host threads (0 on an accelerator)
    sm_count: int = 0  # accelerator SMs (0 on a host)
    thread_scaling: dict[str, float] = field(default_factory=dict)  # threads -> speed relative to all cores
    tables: dict[str, Table] = field(default_factory=dict)  # "expert:bf16", "attention_decode", ...

    KEYS = {"name", "mem_bytes", "mem_bw_bytes_per_s", "peak_flops", "bw_efficiency", "compute_efficiency",
            "layer_overhead_s", "step_overhead_s", "cores", "sm_count", "thread_scaling", "tables"}

    def peak(self, precision: str) -> float:
        """Peak FLOP/s for products whose weights are ``precision`` (int4 weights use the int8 or bf16 rate)."""
        for p in (precision, "int8" if precision == "int4" else None, "bf16", "fp32"):
            if p and p in self.peak_flops:
                return self.peak_flops[p]
        raise ProfileError(f"processor {self.name}: no peak_flops")

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "mem_bytes": self.mem_bytes, "mem_bw_bytes_per_s": self.mem_bw_bytes_per_s,
                "peak_flops": dict(self.peak_flops), "bw_efficiency": self.bw_efficiency,
                "compute_efficiency": self.compute_efficiency, "layer_overhead_s": self.layer_overhead_s,
                "step_overhead_s": self.step_overhead_s, "cores": self.cores, "sm_count": self.sm_count,
                "thread_scaling": dict(self.thread_scaling),
                "tables": {k: t.to_dict() for k, t in sorted(self.tables.items())}}

    @classmethod
    def parse(cls, where: str, data: Any) -> Processor:
        d = _obj(where, data)
        _known(where, d, cls.KEYS)
        for k in ("name", "mem_bytes", "mem_bw_bytes_per_s", "peak_flops"):
            if k not in d:
                raise ProfileError(f"{where}: missing field '{k}'")
        peaks = _obj(f"{where}.peak_flops", d["peak_flops"])
        for p in peaks:
            if p not in PRECISIONS:
                raise ProfileError(f"{where}.peak_flops: unknown precision '{p}' (known: {', '.join(PRECISIONS)})")
        if not peaks:
            raise ProfileError(f"{where}.peak_flops: needs at least one precision")
        tables = {str(k): Table.parse(f"{where}.tables.{k}", v) for k, v in _obj(f"{where}.tables", d.get("tables", {})).items()}
        scaling = {str(k): _num(f"{where}.thread_scaling.{k}", v)
                   for k, v in _obj(f"{where}.thread_scaling", d.get("thread_scaling", {})).items()}
        return cls(
            name=str(d["name"]), mem_bytes=_num(f"{where}.mem_bytes", d["mem_bytes"]),
            mem_bw_bytes_per_s=_num(f"{where}.mem_bw_bytes_per_s", d["mem_bw_bytes_per_s"]),
            peak_flops={p: _num(f"{where}.peak_flops.{p}", v) for p, v in peaks.items()},
            bw_efficiency=_num(f"{where}.bw_efficiency", d.get("bw_efficiency", 0.7), lo=0.01, hi=1.0),
            compute_efficiency=_num(f"{where}.compute_efficiency", d.get("compute_efficiency", 0.5), lo=0.01, hi=1.0),
            layer_overhead_s=_num(f"{where}.layer_overhead_s", d.get("layer_overhead_s", 0.0), positive=False),
            step_overhead_s=_num(f"{where}.step_overhead_s", d.get("step_overhead_s", 0.0), positive=False),
            cores=int(_num(f"{where}.cores", d.get("cores", 0), positive=False)),
            sm_count=int(_num(f"{where}.sm_count", d.get("sm_count", 0), positive=False)),
            thread_scaling=scaling, tables=tables)


@dataclass(frozen=True)
class Link:
    """Host <-> accelerator copies: bandwidth per direction, pinned or pageable, a latency per copy, and
    how many copy engines run beside compute (1+ means copies overlap kernels)."""

    h2d_pinned_bytes_per_s: float
    h2d_pageable_bytes_per_s: float
    d2h_pinned_bytes_per_s: float
    d2h_pageable_bytes_per_s: float
    latency_s: float
    copy_engines: int

    KEYS = {"h2d_pinned_bytes_per_s", "h2d_pageable_bytes_per_s", "d2h_pinned_bytes_per_s",
            "d2h_pageable_bytes_per_s", "latency_s", "copy_engines"}

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in sorted(self.KEYS)}

    @classmethod
    def parse(cls, where: str, data: Any) -> Link:
        d = _obj(where, data)
        _known(where, d, cls.KEYS)
        for k in ("h2d_pinned_bytes_per_s", "d2h_pinned_bytes_per_s"):
            if k not in d:
                raise ProfileError(f"{where}: missing field '{k}'")
        h2d = _num(f"{where}.h2d_pinned_bytes_per_s", d["h2d_pinned_bytes_per_s"])
        d2h = _num(f"{where}.d2h_pinned_bytes_per_s", d["d2h_pinned_bytes_per_s"])
        return cls(h2d, _num(f"{where}.h2d_pageable_bytes_per_s", d.get("h2d_pageable_bytes_per_s", h2d / 2)),
                   d2h, _num(f"{where}.d2h_pageable_bytes_per_s", d.get("d2h_pageable_bytes_per_s", d2h / 2)),
                   _num(f"{where}.latency_s", d.get("latency_s", 1e-5), positive=False),
                   int(_num(f"{where}.copy_engines", d.get("copy_engines", 1), positive=False)))


@dataclass(frozen=True)
class Interconnect:
    """Accelerator <-> accelerator traffic for expert parallelism: NVLink-style direct, or PCIe through
    host memory (consumer GPUs: each transfer crosses the link twice)."""

    kind: str  # "nvlink" | "pcie-p2p" | "pcie-host"
    bytes_per_s: float
    latency_s: float

    KINDS = ("nvlink", "pcie-p2p", "pcie-host")

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "bytes_per_s": self.bytes_per_s, "latency_s": self.latency_s}

    @classmethod
    def parse(cls, where: str, data: Any) -> Interconnect:
        d = _obj(where, data)
        _known(where, d, {"kind", "bytes_per_s", "latency_s"})
        if d.get("kind") not in cls.KINDS:
            raise ProfileError(f"{where}.kind={d.get('kind')!r}: must be one of {', '.join(cls.KINDS)}")
        return cls(d["kind"], _num(f"{where}.bytes_per_s", d.get("bytes_per_s")),
                   _num(f"{where}.latency_s", d.get("latency_s", 1e-5), positive=False))


@dataclass(frozen=True)
class Profile:
    """One machine as the simulator sees it."""

    name: str
    calibrated: bool
    source: str
    host: Processor
    device: Processor | None = None
    link: Link | None = None
    interconnect: Interconnect | None = None
    devices: int = 1

    KEYS = {"format", "version", "name", "calibrated", "source", "host", "device", "link", "interconnect", "devices"}

    def to_dict(self) -> dict[str, Any]:
        return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "name": self.name,
                "calibrated": self.calibrated, "source": self.source, "host": self.host.to_dict(),
                "device": self.device.to_dict() if self.device else None,
                "link": self.link.to_dict() if self.link else None,
                "interconnect": self.interconnect.to_dict() if self.interconnect else None,
                "devices": self.devices}

    def describe(self) -> dict[str, Any]:
        """What a result records of the profile it was priced with."""
        return {"name": self.name, "calibrated": self.calibrated, "source": self.source,
                "host": self.host.name, "device": self.device.name if self.device else None,
                "devices": self.devices}

    @classmethod
    def parse(cls, data: Any, source: str = "profile") -> Profile:
        d = _obj(source, data)
        if d.get("format") != PROFILE_FORMAT:
            raise ProfileError(f"{source}: field 'format'={d.get('format')!r}: expected {PROFILE_FORMAT!r}")
        if d.get("version") != PROFILE_VERSION:
            raise ProfileError(f"{source}: field 'version'={d.get('version')!r}: this moetune reads version "
                               f"{PROFILE_VERSION}")
        _known(source, d, cls.KEYS)
        if not isinstance(d.get("calibrated"), bool):
            raise ProfileError(f"{source}: field 'calibrated'={d.get('calibrated')!r}: expected true or false")
        if "host" not in d:
            raise ProfileError(f"{source}: missing field 'host'")
        device = Processor.parse(f"{source}: device", d["device"]) if d.get("device") is not None else None
        link = Link.parse(f"{source}: link", d["link"]) if d.get("link") is not None else None
        if device is not None and link is None:
            raise ProfileError(f"{source}: field 'link' is needed with a device (host <-> device copies)")
        inter = Interconnect.parse(f"{source}: interconnect", d["interconnect"]) if d.get("interconnect") else None
        n = int(_num(f"{source}: devices", d.get("devices", 1)))
        if n > 1 and inter is None:
            raise ProfileError(f"{source}: field 'devices'={n} needs an 'interconnect'")
        return cls(str(d.get("name") or "unnamed"), d["calibrated"], str(d.get("source", "")),
                   Processor.parse(f"{source}: host", d["host"]), device, link, inter, n)


def load_profile(ref: str | Path) -> Profile:
    """A profile file, or ``builtin:<name>`` (:data:`BUILTIN`; ``builtin:<gpu>+<host>`` pairs them)."""
    text = str(ref)
    if text.startswith("builtin:"):
        return builtin_profile(text.split(":", 1)[1])
    p = Path(text)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise ProfileError(f"{p}: no such profile file (or use builtin:<name>: {', '.join(sorted(BUILTIN))})") from None
    except json.JSONDecodeError as e:
        raise ProfileError(f"{p}: not valid JSON (line {e.lineno}: {e.msg})") from None
    return Profile.parse(data, str(p))


# ---------------------------------------------------------------------------------------- datasheets
# Vendors' published figures (dense tensor-core rates, no sparsity); efficiencies are assumptions until
# a machine of the kind calibrates them. GB = 1e9 bytes.
GB, TB, TFLOP = 1e9, 1e12, 1e12

_GPUS: dict[str, dict[str, Any]] = {
    "h100-pcie": dict(name="NVIDIA H100 PCIe 80GB", mem_bytes=80 * GB, mem_bw_bytes_per_s=2.0 * TB, sm_count=114,
                      peak_flops={"fp32": 51 * TFLOP, "bf16": 756 * TFLOP, "fp16": 756 * TFLOP,
                                  "int8": 1513 * TFLOP}, link="pcie5"),
    "h100-sxm": dict(name="NVIDIA H100 SXM 80GB", mem_bytes=80 * GB, mem_bw_bytes_per_s=3.35 * TB, sm_count=132,
                     peak_flops={"fp32": 67 * TFLOP, "bf16": 989 * TFLOP, "fp16": 989 * TFLOP, "int8": 1979 * TFLOP},
                     link="pcie5", interconnect="nvlink4"),
    "h200": dict(name="NVIDIA H200 141GB", mem_bytes=141 * GB, mem_bw_bytes_per_s=4.8 * TB, sm_count=132,
                 peak_flops={"fp32": 67 * TFLOP, "bf16": 989 * TFLOP, "fp16": 989 * TFLOP, "int8": 1979 * TFLOP},
                 link="pcie5", interconnect="nvlink4"),
    "a100-80gb": dict(name="NVIDIA A100 80GB SXM", mem_bytes=80 * GB, mem_bw_bytes_per_s=2.039 * TB, sm_count=108,
                      peak_flops={"fp32": 19.5 * TFLOP, "bf16": 312 * TFLOP, "fp16": 312 * TFLOP,
                                  "int8": 624 * TFLOP}, link="pcie4", interconnect="nvlink3"),
    "l40s": dict(name="NVIDIA L40S 48GB", mem_bytes=48 * GB, mem_bw_bytes_per_s=864 * GB, sm_count=142,
                 peak_flops={"fp32": 91.6 * TFLOP, "bf16": 362 * TFLOP, "fp16": 362 * TFLOP, "int8": 733 * TFLOP},
                 link="pcie4"),
    "rtx4090": dict(name="NVIDIA GeForce RTX 4090 24GB", mem_bytes=24 * GB, mem_bw_bytes_per_s=1008 * GB,
                    sm_count=128, peak_flops={"fp32": 82.6 * TFLOP, "bf16": 165 * TFLOP, "fp16": 165 * TFLOP,
                                              "int8": 661 * TFLOP}, link="pcie4"),
    "rtx5090": dict(name="NVIDIA GeForce RTX 5090 32GB", mem_bytes=32 * GB, mem_bw_bytes_per_s=1792 * GB,
                    sm_count=170, peak_flops={"fp32": 104.8 * TFLOP, "bf16": 209.5 * TFLOP, "fp16": 209.5 * TFLOP,
                                              "int8": 838 * TFLOP}, link="pcie5"),
}
# PCIe x16 per direction (theoretical 32 / 64 GB/s; pinned copies reach ~80 % of it).
_LINKS = {"pcie4": dict(h2d_pinned_bytes_per_s=25 * GB, h2d_pageable_bytes_per_s=12 * GB,
                        d2h_pinned_bytes_per_s=25 * GB, d2h_pageable_bytes_per_s=10 * GB, latency_s=1e-5,
                        copy_engines=2),
          "pcie5": dict(h2d_pinned_bytes_per_s=50 * GB, h2d_pageable_bytes_per_s=20 * GB,
                        d2h_pinned_bytes_per_s=50 * GB, d2h_pageable_bytes_per_s=18 * GB, latency_s=1e-5,
                        copy_engines=2)}
_INTERCONNECTS = {"nvlink4": dict(kind="nvlink", bytes_per_s=450 * GB, latency_s=3e-6),
                  "nvlink3": dict(kind="nvlink", bytes_per_s=300 * GB, latency_s=3e-6),
                  "pcie4": dict(kind="pcie-host", bytes_per_s=25 * GB, latency_s=1.5e-5),
                  "pcie5": dict(kind="pcie-host", bytes_per_s=50 * GB, latency_s=1.5e-5)}
# Hosts: memory bandwidth is channels x MT/s x 8 bytes; peaks are cores x FLOP/cycle x clock (AMX bf16:
# 1024 FLOP/cycle/core; AVX-512 FMA fp32: 64; int8 VNNI: 256).
_HOSTS: dict[str, dict[str, Any]] = {
    "spr": dict(name="Xeon Sapphire Rapids 56-core socket, 8x DDR5-4800 (AMX)", cores=56, mem_bytes=512 * GB,
                mem_bw_bytes_per_s=307 * GB, peak_flops={"fp32": 56 * 64 * 2.0e9, "bf16": 56 * 1024 * 2.0e9,
                                                         "int8": 56 * 2048 * 2.0e9}),
    "zen4-desktop": dict(name="Ryzen 9 7950X 16-core, 2x DDR5-6000", cores=16, mem_bytes=64 * GB,
                         mem_bw_bytes_per_s=96 * GB, peak_flops={"fp32": 16 * 32 * 4.5e9, "bf16": 16 * 64 * 4.5e9,
                                                                 "int8": 16 * 128 * 4.5e9}),
    "epyc-genoa": dict(name="EPYC Genoa 96-core socket, 12x DDR5-4800", cores=96, mem_bytes=768 * GB,
                       mem_bw_bytes_per_s=460 * GB, peak_flops={"fp32": 96 * 32 * 2.4e9, "bf16": 96 * 64 * 2.4e9,
                                                                "int8": 96 * 128 * 2.4e9}),
}
_PAIRS = {"h100-pcie": "spr", "h100-sxm": "spr", "h200": "spr", "a100-80gb": "epyc-genoa", "l40s": "epyc-genoa",
          "rtx4090": "zen4-desktop", "rtx5090": "zen4-desktop"}
# Assumed until calibrated: GPUs reach ~80 % of HBM bandwidth on streaming GEMVs and ~60 % of the tensor
# peak on large GEMMs; launching a decoder layer's kernels costs ~40 us from Python, a step ~1 ms.
_GPU_EFF = dict(bw_efficiency=0.8, compute_efficiency=0.6, layer_overhead_s=40e-6, step_overhead_s=1e-3)
_HOST_EFF = dict(bw_efficiency=0.6, compute_efficiency=0.3, layer_overhead_s=60e-6, step_overhead_s=1e-3)


def _host(key: str) -> dict[str, Any]:
    h = dict(_HOSTS[key])
    return {**h, **_HOST_EFF}


def builtin_profile(name: str) -> Profile:
    """``rtx4090`` (paired with its usual host), ``h100-pcie+spr`` (an explicit pair), ``h100-sxm x4``-style
    counts as ``h100-sxm*4``, or a host alone (``spr``)."""
    base, _, count = name.partition("*")
    gpu, _, host = base.partition("+")
    if gpu in _HOSTS and not host:
        data = {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "name": gpu, "calibrated": False,
                "source": "datasheet", "host": _host(gpu)}
        return Profile.parse(data, f"builtin:{name}")
    if gpu not in _GPUS:
        raise ProfileError(f"builtin:{name}: unknown profile (known: {', '.join(sorted(BUILTIN))}, or "
                           f"<gpu>+<host> with hosts {', '.join(sorted(_HOSTS))}, and <gpu>*<count>)")
    host = host or _PAIRS[gpu]
    if host not in _HOSTS:
        raise ProfileError(f"builtin:{name}: unknown host {host!r} (known: {', '.join(sorted(_HOSTS))})")
    g = dict(_GPUS[gpu])
    link, inter = g.pop("link"), g.pop("interconnect", None)
    n = int(count) if count.isdigit() and int(count) > 0 else None
    if count and n is None:
        raise ProfileError(f"builtin:{name}: the device count after '*' must be a positive integer")
    data = {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "name": name, "calibrated": False,
            "source": "datasheet", "host": _host(host), "device": {**g, **_GPU_EFF}, "link": _LINKS[link],
            "interconnect": _INTERCONNECTS[inter or link], "devices": n or 1}
    return Profile.parse(data, f"builtin:{name}")


BUILTIN = tuple(sorted(_GPUS)) + tuple(sorted(_HOSTS))
