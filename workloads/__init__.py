"""Recorded and synthetic workloads for moetune: requests, arrivals, router traces (see FORMAT.md)."""

from workloads.errors import WorkloadError
from workloads.router import RouterTrace
from workloads.schema import Request, Workload, builtin_names, load_workload, save_workload

__all__ = ["Request", "RouterTrace", "Workload", "WorkloadError", "builtin_names", "load_workload", "save_workload"]
