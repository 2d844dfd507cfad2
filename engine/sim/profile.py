"""Hardware profiles: what the simulator knows of a machine, as a validated JSON file.

A profile describes a host (CPU and memory), optionally one accelerator, and the link between
them. Two kinds exist:

- measured: ``engine calibrate --out profile.json`` times this machine's own operations with the
  engine's kernels and stores them as tables (seconds against tokens, or against batch and context)
  beside the fitted overheads; ``calibrated: true``, with the machine's fingerprint in ``measured``;
- datasheet: built-in profiles of machines that are not here (``builtin:rtx4090``,
  ``builtin:h100-pcie``, ...), from vendors' published bandwidths and peak rates with assumed
  efficiencies; ``calibrated: false``, and every result that uses one says so.

What a processor's fields mean (all seconds, bytes and FLOP/s; see :mod:`engine.sim.step` for how
the pricer combines them):

- ``mem_bytes``, ``mem_bw_bytes_per_s``, ``peak_flops`` per weight precision, ``bw_efficiency`` and
  ``compute_efficiency``: the roofline used where no table covers an operation;
- ``tables``: measured operations. A key names the operation, the weight precision and the compute
  precision: ``expert:bf16@fp32`` (one expert's SwiGLU product on the per-expert path, against tokens),
  ``expert_torch:int8@fp32`` (the same without the CPU engine's native kernels: ``cpu_kernels=torch``),
  ``expert_fused:int8@fp32`` (one expert inside one fused call for a whole layer), ``matmul:bf16@fp32``
  (tokens times one dense weight), ``moe_fused_call@fp32`` and ``moe_grouped_call@fp32`` (a layer
  call's fixed work against tokens or routed slots), ``attention_decode@fp32`` (a grid: decode batch by
  mean KV length), ``attention_prefill@fp32`` (a grid: chunk tokens by context), ``quantize:int8``
  (building one expert's copy in that precision). Each table carries the ``shape`` it was measured at;
  the pricer scales it to other shapes by weight elements;
- overheads: ``step_overhead_s`` (per step), ``token_overhead_s`` (per token of a step),
  ``layer_overhead_s`` (per decoder layer: dispatch), ``moe_layer_overhead_s`` (extra per MoE layer
  when the hybrid expert executor runs), ``part_overhead_s`` (per micro-batch), ``call_overhead_s``
  (per kernel launch on the per-expert path, where no table has it);
- ``cores`` and ``threads`` (the thread count the tables were measured with; 0 = every core),
  ``thread_scaling`` (threads -> speed relative to ``threads``), ``sm_count`` and ``sm_scaling``
  (share of SMs -> speed of expert products), ``copy_bytes_per_s`` (a copy within this memory);
- ``native_max_tokens`` and ``fused_max_tokens_per_expert``: where the engine's CPU paths switch
  (products of more tokens use the GEMM path; a layer's fused call takes at most this many routed
  slots per expert on average); 0 where the processor has no native kernels.

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
COMPUTES = ("fp32", "bf16", "fp16")


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
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ProfileError(f"{where}={value!r}: must be within [{lo}, {hi}]")
    return v


def _int(where: str, value: Any, *, positive: bool = False) -> int:
    v = _num(where, value, positive=positive)
    if not v.is_integer():
        raise ProfileError(f"{where}={value!r}: expected an integer")
    return int(v)


def _obj(where: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ProfileError(f"{where}={value!r}: expected an object")
    return value


def _known(where: str, data: dict[str, Any], allowed: set[str]) -> None:
    for k in data:
        if k not in allowed:
            raise ProfileError(f"{where}: unknown field '{k}' (value {data[k]!r}); known: {', '.join(sorted(allowed))}")


def _axis(where: str, values: Any) -> tuple[float, ...]:
    if not isinstance(values, list) or not values:
        raise ProfileError(f"{where}={values!r}: expected a non-empty list of numbers")
    out = tuple(_num(f"{where}[{i}]", v) for i, v in enumerate(values))
    if any(b <= a for a, b in zip(out, out[1:], strict=False)):
        raise ProfileError(f"{where}={values!r}: must be strictly increasing")
    return out


def _interp_log(xs: tuple[float, ...], ys: tuple[float, ...], x: float) -> float:
    """Linear interpolation of log(y) against log(x); constant below the first point (a fixed cost
    dominates there), beyond the last the last segment's slope held within [0, 1] (work grows at
    most in proportion to the tokens: a noisy last pair of points must not extrapolate as a power)."""
    if len(xs) == 1 or x <= xs[0]:
        return ys[0]
    if x > xs[-1]:
        slope = (math.log(ys[-1]) - math.log(ys[-2])) / (math.log(xs[-1]) - math.log(xs[-2]))
        return math.exp(math.log(ys[-1]) + min(1.0, max(0.0, slope)) * (math.log(x) - math.log(xs[-1])))
    i = len(xs) - 2 if x >= xs[-1] else next(j for j in range(len(xs) - 1) if xs[j] <= x <= xs[j + 1])
    x0, x1 = math.log(xs[i]), math.log(xs[i + 1])
    y0, y1 = math.log(ys[i]), math.log(ys[i + 1])
    return math.exp(y0 + (math.log(x) - x0) / (x1 - x0) * (y1 - y0))


def _shape(where: str, data: Any) -> dict[str, int]:
    return {str(k): _int(f"{where}.{k}", v, positive=True) for k, v in _obj(where, data).items()}


@dataclass(frozen=True)
class Table:
    """Measured seconds at points ``x`` (tokens, slots, ...), interpolated in log-log space."""

    x: tuple[float, ...]
    seconds: tuple[float, ...]
    shape: dict[str, int] = field(default_factory=dict)  # the operation's sizes at measurement

    def at(self, x: float) -> float:
        return _interp_log(self.x, self.seconds, x)

    def to_dict(self) -> dict[str, Any]:
        return {"x": list(self.x), "seconds": list(self.seconds), "shape": dict(self.shape)}

    @classmethod
    def parse(cls, where: str, data: Any) -> Table | Grid:
        d = _obj(where, data)
        if "y" in d:
            return Grid.parse(where, d)
        _known(where, d, {"x", "seconds", "shape"})
        x = _axis(f"{where}.x", d.get("x"))
        ys = d.get("seconds")
        if not isinstance(ys, list) or len(ys) != len(x):
            raise ProfileError(f"{where}.seconds={ys!r}: expected a list as long as 'x' ({len(x)})")
        y = tuple(_num(f"{where}.seconds[{i}]", v) for i, v in enumerate(ys))
        return cls(x, y, _shape(f"{where}.shape", d.get("shape", {})))


@dataclass(frozen=True)
class Grid:
    """Measured seconds on a grid ``x`` by ``y`` (batch by KV length, chunk by context): bilinear in
    log-log space, clamped below the first point of each axis and extrapolated beyond the last."""

    x: tuple[float, ...]
    y: tuple[float, ...]
    seconds: tuple[tuple[float, ...], ...]  # [len(x)][len(y)]
    shape: dict[str, int] = field(default_factory=dict)

    def at(self, x: float, y: float) -> float:
        col = tuple(_interp_log(self.y, row, y) for row in self.seconds)  # along y for each x
        return _interp_log(self.x, col, x)

    def to_dict(self) -> dict[str, Any]:
        return {"x": list(self.x), "y": list(self.y), "seconds": [list(r) for r in self.seconds],
                "shape": dict(self.shape)}

    @classmethod
    def parse(cls, where: str, data: Any) -> Grid:
        d = _obj(where, data)
        _known(where, d, {"x", "y", "seconds", "shape"})
        x, y = _axis(f"{where}.x", d.get("x")), _axis(f"{where}.y", d.get("y"))
        rows = d.get("seconds")
        if not isinstance(rows, list) or len(rows) != len(x) or not all(
                isinstance(r, list) and len(r) == len(y) for r in rows):
            raise ProfileError(f"{where}.seconds: expected {len(x)} lists of {len(y)} numbers (x by y)")
        secs = tuple(tuple(_num(f"{where}.seconds[{i}][{j}]", v) for j, v in enumerate(r)) for i, r in enumerate(rows))
        return cls(x, y, secs, _shape(f"{where}.shape", d.get("shape", {})))


def _share_map(where: str, data: Any, *, lo: float, hi: float) -> dict[float, float]:
    """``{"0.5": 0.61, ...}`` -> {0.5: 0.61}: a key in [lo, hi], a positive relative speed."""
    out = {}
    for k, v in _obj(where, data).items():
        try:
            key = float(k)
        except ValueError:
            raise ProfileError(f"{where}: key {k!r} is not a number") from None
        if not lo <= key <= hi:
            raise ProfileError(f"{where}: key {k!r} must be within [{lo:g}, {hi:g}]")
        out[key] = _num(f"{where}.{k}", v)
    return out


@dataclass(frozen=True)
class Processor:
    """A host CPU or an accelerator (see the module docstring for what each field means)."""

    name: str
    mem_bytes: float
    mem_bw_bytes_per_s: float
    peak_flops: dict[str, float]
    bw_efficiency: float = 0.7
    compute_efficiency: float = 0.5
    step_overhead_s: float = 0.0
    token_overhead_s: float = 0.0
    layer_overhead_s: float = 0.0
    moe_layer_overhead_s: float = 0.0
    part_overhead_s: float = 0.0
    call_overhead_s: float = 0.0
    cores: int = 0
    threads: int = 0
    sm_count: int = 0
    thread_scaling: dict[float, float] = field(default_factory=dict)
    sm_scaling: dict[float, float] = field(default_factory=dict)
    copy_bytes_per_s: float = 0.0  # 0: half the memory bandwidth (a copy reads and writes)
    native_max_tokens: int = 0
    fused_max_tokens_per_expert: int = 0
    tables: dict[str, Table | Grid] = field(default_factory=dict)

    NUMBERS = ("bw_efficiency", "compute_efficiency", "step_overhead_s", "token_overhead_s", "layer_overhead_s",
               "moe_layer_overhead_s", "part_overhead_s", "call_overhead_s", "copy_bytes_per_s")
    INTS = ("cores", "threads", "sm_count", "native_max_tokens", "fused_max_tokens_per_expert")
    KEYS = {"name", "mem_bytes", "mem_bw_bytes_per_s", "peak_flops", "thread_scaling", "sm_scaling", "tables",
            *NUMBERS, *INTS}

    def peak(self, precision: str) -> float:
        """Peak FLOP/s for products whose weights are ``precision`` (int4 weights use the int8 or bf16 rate)."""
        for p in (precision, "int8" if precision == "int4" else None, "bf16", "fp32"):
            if p and p in self.peak_flops:
                return self.peak_flops[p]
        raise ProfileError(f"processor {self.name}: no peak_flops")

    @property
    def copy_bw(self) -> float:
        return self.copy_bytes_per_s or self.mem_bw_bytes_per_s * self.bw_efficiency / 2

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "mem_bytes": self.mem_bytes,
                               "mem_bw_bytes_per_s": self.mem_bw_bytes_per_s, "peak_flops": dict(self.peak_flops)}
        out.update({k: getattr(self, k) for k in (*self.NUMBERS, *self.INTS)})
        out["thread_scaling"] = {f"{k:g}": v for k, v in sorted(self.thread_scaling.items())}
        out["sm_scaling"] = {f"{k:g}": v for k, v in sorted(self.sm_scaling.items())}
        out["tables"] = {k: t.to_dict() for k, t in sorted(self.tables.items())}
        return out

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
        tables = {str(k): Table.parse(f"{where}.tables.{k}", v)
                  for k, v in _obj(f"{where}.tables", d.get("tables", {})).items()}
        nums: dict[str, Any] = {}
        for k in cls.NUMBERS:
            if k in d:
                eff = k.endswith("efficiency")
                nums[k] = _num(f"{where}.{k}", d[k], positive=eff, lo=0.01 if eff else None, hi=1.0 if eff else None)
        for k in cls.INTS:
            if k in d:
                nums[k] = _int(f"{where}.{k}", d[k])
        cores = nums.get("cores", 0)
        scaling = _share_map(f"{where}.thread_scaling", d.get("thread_scaling", {}), lo=1, hi=max(cores, 1))
        sms = _share_map(f"{where}.sm_scaling", d.get("sm_scaling", {}), lo=0.0, hi=1.0)
        return cls(name=str(d["name"]), mem_bytes=_num(f"{where}.mem_bytes", d["mem_bytes"]),
                   mem_bw_bytes_per_s=_num(f"{where}.mem_bw_bytes_per_s", d["mem_bw_bytes_per_s"]),
                   peak_flops={p: _num(f"{where}.peak_flops.{p}", v) for p, v in peaks.items()},
                   thread_scaling=scaling, sm_scaling=sms, tables=tables, **nums)


@dataclass(frozen=True)
class Link:
    """Host <-> accelerator copies: bandwidth per direction, pinned or pageable, a latency per copy, how
    many copy engines run beside compute, and ``overlap``: the share of a copy's time that hides behind
    kernels running at the same time (1: copy engines and SMs do not slow each other)."""

    h2d_pinned_bytes_per_s: float
    h2d_pageable_bytes_per_s: float
    d2h_pinned_bytes_per_s: float
    d2h_pageable_bytes_per_s: float
    latency_s: float = 1e-5
    copy_engines: int = 1
    overlap: float = 1.0

    KEYS = {"h2d_pinned_bytes_per_s", "h2d_pageable_bytes_per_s", "d2h_pinned_bytes_per_s",
            "d2h_pageable_bytes_per_s", "latency_s", "copy_engines", "overlap"}

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
                   _int(f"{where}.copy_engines", d.get("copy_engines", 1), positive=True),
                   _num(f"{where}.overlap", d.get("overlap", 1.0), positive=False, lo=0.0, hi=1.0))


@dataclass(frozen=True)
class Interconnect:
    """Accelerator <-> accelerator traffic: NVLink-style direct, or PCIe (through host memory on
    consumer GPUs): bandwidth per direction and latency per hop. Multi-device profiles need one; it
    prices expert parallelism's all-reduce (:func:`engine.sim.cost.all_reduce_s`)."""

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
    measured: dict[str, Any] = field(default_factory=dict)
    """For a calibrated profile: the machine's fingerprint, CPU, GPU, software and date of measurement."""

    KEYS = {"format", "version", "name", "calibrated", "source", "host", "device", "link", "interconnect", "devices",
            "measured"}

    @property
    def fast(self) -> Processor:
        """The processor of the fast tier: the accelerator, or the host on a host-only profile."""
        return self.device or self.host

    def to_dict(self) -> dict[str, Any]:
        return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "name": self.name,
                "calibrated": self.calibrated, "source": self.source, "measured": dict(self.measured),
                "host": self.host.to_dict(), "device": self.device.to_dict() if self.device else None,
                "link": self.link.to_dict() if self.link else None,
                "interconnect": self.interconnect.to_dict() if self.interconnect else None,
                "devices": self.devices}

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        tmp.replace(p)
        return p

    def describe(self) -> dict[str, Any]:
        """What a result records of the profile it was priced with."""
        return {"name": self.name, "calibrated": self.calibrated, "source": self.source,
                "host": self.host.name, "device": self.device.name if self.device else None,
                "devices": self.devices, "hardware_fingerprint": self.measured.get("hardware_fingerprint")}

    def hardware(self) -> dict[str, Any]:
        """The machine the profile describes, in the form of :func:`engine.hwinfo.hardware` (the tuner's
        search space and the study record read it)."""
        dev = self.device
        hw: dict[str, Any] = {
            "cpu_model": self.host.name, "cpu_cores": self.host.cores, "mem_total_bytes": int(self.host.mem_bytes),
            "gpu": None if dev is None else {"name": dev.name, "count": self.devices,
                                             "mem_total_bytes": int(dev.mem_bytes), "sm_count": dev.sm_count},
            "profile": self.describe(),
        }
        hw["fingerprint"] = self.measured.get("hardware_fingerprint") or f"profile:{self.name}"
        return hw

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
        n = _int(f"{source}: devices", d.get("devices", 1), positive=True)
        if n > 1 and inter is None:
            raise ProfileError(f"{source}: field 'devices'={n} needs an 'interconnect'")
        if n > 1 and device is None:
            raise ProfileError(f"{source}: field 'devices'={n} needs a 'device'")
        measured = _obj(f"{source}: measured", d.get("measured") or {})
        return cls(str(d.get("name") or "unnamed"), d["calibrated"], str(d.get("source", "")),
                   Processor.parse(f"{source}: host", d["host"]), device, link, inter, n, dict(measured))


def machine_mismatch(described: dict[str, Any], here: dict[str, Any]) -> str | None:
    """Why the machine a profile describes (``Profile.describe()``, as results store it) is not the machine
    ``here`` (:func:`engine.hwinfo.hardware`), or None when it is. Only a profile calibrated here matches:
    its ``hardware_fingerprint`` is this machine's (CPU model, cores, GPU). A datasheet profile names a
    machine by its vendor's figures, which no fingerprint ties to a machine, so it never matches."""
    name = described.get("name") or "unnamed"
    fingerprint = described.get("hardware_fingerprint")
    if fingerprint and fingerprint == here.get("fingerprint"):
        return None
    gpu = (here.get("gpu") or {}).get("name")
    this = f"this machine is {here.get('cpu_model') or 'an unknown CPU'}" + (f" with {gpu}" if gpu else ", no GPU") \
        + f" (hardware fingerprint {here.get('fingerprint')})"
    machine = " + ".join(x for x in (described.get("device"), described.get("host")) if x) or "an unnamed machine"
    if not described.get("calibrated") or not fingerprint:
        return f"profile {name} is a datasheet profile of {machine}, not calibrated here; {this}"
    return f"profile {name} was calibrated on another machine ({machine}, hardware fingerprint {fingerprint}); {this}"


def load_profile(ref: str | Path) -> Profile:
    """A profile file, or ``builtin:<name>`` (:data:`BUILTIN`; ``builtin:<gpu>+<host>`` pairs them)."""
    text = str(ref)
    if text.startswith("builtin:"):
        return builtin_profile(text.split(":", 1)[1])
    p = Path(text)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise ProfileError(f"{p}: no such profile file (or use builtin:<name>: {', '.join(BUILTIN)})") from None
    except IsADirectoryError:
        raise ProfileError(f"{p}: is a directory, not a profile file") from None
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
                        copy_engines=2, overlap=1.0),
          "pcie5": dict(h2d_pinned_bytes_per_s=50 * GB, h2d_pageable_bytes_per_s=20 * GB,
                        d2h_pinned_bytes_per_s=50 * GB, d2h_pageable_bytes_per_s=18 * GB, latency_s=1e-5,
                        copy_engines=2, overlap=1.0)}
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
    "zen4-desktop": dict(name="Ryzen 9 7950X 16-core, 2x DDR5-6000, 64 GB", cores=16, mem_bytes=64 * GB,
                         mem_bw_bytes_per_s=96 * GB, peak_flops={"fp32": 16 * 32 * 4.5e9, "bf16": 16 * 64 * 4.5e9,
                                                                 "int8": 16 * 128 * 4.5e9}),
    "epyc-genoa": dict(name="EPYC Genoa 96-core socket, 12x DDR5-4800", cores=96, mem_bytes=768 * GB,
                       mem_bw_bytes_per_s=460 * GB, peak_flops={"fp32": 96 * 32 * 2.4e9, "bf16": 96 * 64 * 2.4e9,
                                                                "int8": 96 * 128 * 2.4e9}),
}
_PAIRS = {"h100-pcie": "spr", "h100-sxm": "spr", "h200": "spr", "a100-80gb": "epyc-genoa", "l40s": "epyc-genoa",
          "rtx4090": "zen4-desktop", "rtx5090": "zen4-desktop"}
# Assumed until calibrated: GPUs reach ~80 % of HBM bandwidth on streaming GEMVs and ~60 % of the tensor
# peak on large GEMMs; launching a kernel costs ~5 us, a decoder layer's dispatch from Python ~40 us, a
# step ~1 ms. Hosts: ~60 % of DRAM bandwidth, ~30 % of peak; ~60 us per layer of Python dispatch.
_GPU_EFF = dict(bw_efficiency=0.8, compute_efficiency=0.6, layer_overhead_s=40e-6, step_overhead_s=1e-3,
                call_overhead_s=5e-6, part_overhead_s=20e-6, moe_layer_overhead_s=30e-6)
_HOST_EFF = dict(bw_efficiency=0.6, compute_efficiency=0.3, layer_overhead_s=60e-6, step_overhead_s=1e-3,
                 call_overhead_s=5e-6, part_overhead_s=20e-6, moe_layer_overhead_s=30e-6,
                 native_max_tokens=32, fused_max_tokens_per_expert=32)  # the engine's kernels build there


def _host(key: str) -> dict[str, Any]:
    return {**_HOSTS[key], **_HOST_EFF}


def builtin_profile(name: str) -> Profile:
    """``rtx4090`` (paired with its usual host), ``h100-pcie+spr`` (an explicit pair), ``h100-sxm*4``
    (a device count), or a host alone (``spr``)."""
    base, _, count = name.partition("*")
    gpu, _, host = base.partition("+")
    if gpu in _HOSTS and not host and not count:
        data = {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "name": gpu, "calibrated": False,
                "source": "datasheet", "host": _host(gpu)}
        return Profile.parse(data, f"builtin:{name}")
    if gpu not in _GPUS:
        raise ProfileError(f"builtin:{name}: unknown profile (known: {', '.join(BUILTIN)}, or "
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
