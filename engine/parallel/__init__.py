"""Expert parallelism across processes with ``torch.distributed``: ``parallel.ep_size`` ranks.

:mod:`engine.parallel.group` launches the ranks and carries rank 0's commands (every rank runs the
same steps; attention and dense layers replicated); :mod:`engine.parallel.ep` runs one rank's experts
and the MoE layer's combine. Which rank holds which experts, who computes each routed token and what
the communication costs are pure policy in :mod:`engine.moe.policy.placement`, shared with the
simulator.
"""

from collections.abc import Mapping
from typing import Any


def inert_here(hardware: Mapping[str, Any]) -> dict[str, str]:
    """``parallel.ep_size`` searched only with two GPUs or more (``engine.hwinfo.hardware()``): on the CPU or
    one GPU every rank shares the same memory and cores, so more ranks add collectives and no bandwidth
    (``engine run|bench --ep N`` still runs there; the README's Scale out measures it)."""
    gpus = int((hardware.get("gpu") or {}).get("count") or 0)
    if gpus >= 2:
        return {}
    where = "one GPU" if gpus == 1 else "the CPU"
    return {"parallel.ep_size": f"expert parallelism needs 2+ GPUs to add bandwidth; on {where} the ranks share "
                                "one memory and its cores"}


class EPError(RuntimeError):
    """An expert-parallel rank died, hung or failed; the message is one line naming it. (Declared here,
    without torch, so command entry points can catch it.)"""


__all__ = ["EPError", "inert_here"]
