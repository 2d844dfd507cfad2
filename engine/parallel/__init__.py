"""Expert parallelism across processes with ``torch.distributed``: ``parallel.ep_size`` ranks.

:mod:`engine.parallel.group` launches the ranks and carries rank 0's commands (every rank runs the
same steps; attention and dense layers replicated); :mod:`engine.parallel.ep` runs one rank's experts
and the MoE layer's combine. Which rank holds which experts, who computes each routed token and what
the communication costs are pure policy in :mod:`engine.moe.policy.placement`, shared with the
simulator.
"""



class EPError(RuntimeError):
    """An expert-parallel rank died, hung or failed; the message is one line naming it. (Declared here,
    without torch, so command entry points can catch it.)"""


__all__ = ["EPError"]
