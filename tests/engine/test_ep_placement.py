"""Expert placement across ranks and its accounting: pure policy, no torch (engine.moe.policy.placement)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from engine.moe.policy.placement import (
    EPStats,
    assign_pairs,
    eplb_copies,
    imbalance,
    place_experts,
    rank_loads,
    step_traffic,
)


def skewed_routes(n_tokens: int, n_experts: int, top_k: int, seed: int = 0, zipf: float = 1.2) -> np.ndarray:
    """[T, K] distinct expert ids per token drawn from a Zipf-like popularity (expert 0 hottest)."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, n_experts + 1) ** zipf
    p /= p.sum()
    return np.stack([rng.choice(n_experts, top_k, replace=False, p=p) for _ in range(n_tokens)])


def hotness_of(ids: np.ndarray, n_experts: int) -> np.ndarray:
    c = np.bincount(ids[ids >= 0], minlength=n_experts).astype(np.float64)
    return c / c.sum()


@pytest.mark.parametrize("n_ranks,n_experts", [(1, 8), (2, 8), (3, 8), (4, 16), (8, 8), (3, 64)])
@pytest.mark.parametrize("policy", ["contiguous", "hotness", "eplb"])
def test_every_expert_has_a_copy_and_ranks_hold_equal_shares(policy, n_ranks, n_experts):
    hot = hotness_of(skewed_routes(64, n_experts, 2, seed=n_ranks), n_experts)[None].repeat(2, axis=0)
    pl = place_experts(policy, n_ranks, n_experts, 2, hot)
    for li in range(2):
        assert all(len(r) == 1 for r in pl.copies[li])  # no redundant copies asked for
        assert sorted(e for r in range(n_ranks) for e in pl.experts_on(li, r)) == list(range(n_experts))
        slots = pl.slots(li)
        assert max(slots) - min(slots) <= 1, slots


def test_contiguous_is_blocks_of_consecutive_experts():
    pl = place_experts("contiguous", 2, 8, 1)
    assert pl.experts_on(0, 0) == (0, 1, 2, 3) and pl.experts_on(0, 1) == (4, 5, 6, 7)
    assert place_experts("contiguous", 3, 8, 1).slots(0) == [3, 3, 2]


@pytest.mark.parametrize("n_ranks,n_experts,top_k", [(2, 8, 2), (4, 16, 4), (3, 60, 4), (8, 64, 8)])
def test_hotness_placement_cuts_imbalance_on_a_skewed_trace(n_ranks, n_experts, top_k):
    """The recorded hotness of one half of a skewed trace places the experts; on the other half the
    hottest rank's load over the mean falls well below contiguous placement's."""
    ids = skewed_routes(800, n_experts, top_k, seed=3)
    fit, held = ids[:400], ids[400:]
    hot = hotness_of(fit, n_experts)[None]
    contiguous = place_experts("contiguous", n_ranks, n_experts, 1)
    by_hot = place_experts("hotness", n_ranks, n_experts, 1, hot)
    imb_c = imbalance(rank_loads(np.bincount(held.reshape(-1), minlength=n_experts), contiguous, 0))
    imb_h = imbalance(rank_loads(np.bincount(held.reshape(-1), minlength=n_experts), by_hot, 0))
    assert imb_c > 1.5
    assert imb_h < 1.2  # the hottest expert alone carries about a sixth of the pairs at 4 ranks of 16 top-4
    assert imb_h < imb_c - 0.4


def test_eplb_replicates_the_hottest_experts_on_other_ranks_and_balances_further():
    n_ranks, n_experts, top_k = 4, 16, 2
    ids = skewed_routes(2000, n_experts, top_k, seed=5, zipf=1.6)
    hot = hotness_of(ids, n_experts)[None]
    counts = np.bincount(ids.reshape(-1), minlength=n_experts)
    by_hot = place_experts("hotness", n_ranks, n_experts, 1, hot)
    eplb = place_experts("eplb", n_ranks, n_experts, 1, hot, redundant=4)
    copies = [len(r) for r in eplb.copies[0]]
    assert sum(copies) == n_experts + 4
    assert copies[0] == max(copies) > 1  # the hottest expert got extra copies
    for ranks in eplb.copies[0]:
        assert len(set(ranks)) == len(ranks)  # never two copies of one expert on one rank
    assert max(eplb.slots(0)) - min(eplb.slots(0)) <= 1
    # With one expert carrying more than a rank's fair share, only replicas can balance the ranks.
    assert counts[0] / counts.sum() > 1 / n_ranks
    assert imbalance(rank_loads(counts, eplb, 0)) < imbalance(rank_loads(counts, by_hot, 0)) - 0.3
    assert imbalance(rank_loads(counts, eplb, 0)) < 1.15


def test_eplb_copies_go_to_the_highest_load_per_copy():
    assert eplb_copies([0.5, 0.3, 0.2], 2, 4) == [2, 2, 1]  # 0.5 -> 0.25 per copy, then 0.3 is the highest
    assert eplb_copies([0.9, 0.1], 5, 2) == [2, 2]  # at most one copy per rank
    assert eplb_copies([0.25] * 4, 0, 2) == [1, 1, 1, 1]


@pytest.mark.parametrize("redundant", [0, 3, 7])
def test_assigned_pairs_agree_with_rank_loads_and_split_replicas_in_token_order(redundant):
    n_ranks, n_experts = 3, 8
    ids = skewed_routes(37, n_experts, 3, seed=redundant)
    ids[5, 1] = -1  # a pruned slot is computed nowhere
    ids[11] = -1
    hot = hotness_of(ids, n_experts)[None]
    pl = place_experts("eplb" if redundant else "hotness", n_ranks, n_experts, 1, hot, redundant=redundant)
    owner = assign_pairs(ids, pl, 0)
    assert owner.shape == ids.shape
    assert (owner[ids < 0] == -1).all() and (owner[ids >= 0] >= 0).all()
    for t, k in zip(*np.nonzero(ids >= 0), strict=True):
        assert owner[t, k] in pl.copies[0][ids[t, k]]  # computed where a copy lives
    counts = np.bincount(ids[ids >= 0], minlength=n_experts)
    assert np.bincount(owner[owner >= 0], minlength=n_ranks).tolist() == rank_loads(counts, pl, 0).tolist()
    for e, ranks in enumerate(pl.copies[0]):
        if len(ranks) > 1:  # contiguous runs in token order, copy by copy
            seq = owner.reshape(-1)[ids.reshape(-1) == e].tolist()
            assert seq == sorted(seq, key=list(ranks).index)


def test_bad_arguments_are_refused_with_the_value():
    with pytest.raises(ValueError, match="n_ranks=9"):
        place_experts("contiguous", 9, 8, 1)
    with pytest.raises(ValueError, match="redundant=2: only the eplb"):
        place_experts("hotness", 2, 8, 1, redundant=2)
    with pytest.raises(ValueError, match="redundant=9"):
        place_experts("eplb", 2, 8, 1, redundant=9)
    with pytest.raises(ValueError, match="shape"):
        place_experts("hotness", 2, 8, 2, np.ones((1, 8)) / 8)
    with pytest.raises(ValueError, match="'nope'"):
        place_experts("nope", 2, 8, 1)


def test_traffic_and_stats_of_a_run():
    assert step_traffic(10, 64, 4, 1) == (0, 0)
    assert step_traffic(10, 64, 4, 2) == (0, 10 * 64 * 4)  # ring all-reduce: 2 (N-1)/N of the tensor
    assert step_traffic(3, 8, 2, 4) == (0, 2 * 3 * 3 * 8 * 2 // 4)
    st = EPStats(n_ranks=2, n_layers=2, hidden=64, elem_bytes=4)
    st.add_layer(0, np.array([6, 2]), 4)
    st.add_layer(1, np.array([4, 4]), 4)
    st.end_step()
    st.add_layer(0, np.array([1, 1]), 1)
    st.add_layer(1, np.array([2, 0]), 1)
    st.end_step()
    s = st.summary()
    assert s["tokens_per_rank"] == [13, 7]
    assert s["imbalance_per_layer"] == [pytest.approx(7 / 5), pytest.approx(6 / 5)]
    assert s["imbalance_max"] == pytest.approx(1.4)
    assert s["steps"][0] == {"bytes_dispatched": 0, "bytes_combined": 2 * 4 * 64 * 4,
                             "imbalance": pytest.approx((1.5 + 1.0) / 2), "tokens_per_rank": [10, 6]}
    assert s["steps"][1]["imbalance"] == pytest.approx((1.0 + 2.0) / 2)
    assert s["step_imbalance_mean"] == pytest.approx((1.25 + 1.5) / 2)
    assert s["bytes_combined"] == 2 * 4 * 64 * 4 + 2 * 1 * 64 * 4
    st.reset()
    assert st.summary()["tokens_per_rank"] == [0, 0] and st.summary()["steps"] == []
    assert imbalance([0, 0]) == 1.0


def test_placement_imports_no_torch():
    code = ("import sys; import engine.moe.policy.placement as p; "
            "p.place_experts('eplb', 2, 8, 1, None, 2); assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
