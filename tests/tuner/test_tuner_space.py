"""The search space: generated from the knob registry, conditional knobs, inert knobs, a stable hash."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import optuna
import pytest

from engine.config import EP_HONOURS, ConfigError, EngineConfig, KnobInfo, Search, knobs
from tuner.baselines import BASELINES, Baseline, BaselineContext, baseline_points
from tuner.space import Condition, build_space, inert_knobs, parse_fixed

HW = {"cpu_model": "test", "cpu_cores": 2, "gpu": None}
#: Knobs searched since the first engine; the registry grows, these stay.
CORE = {"runtime.compute_dtype", "scheduler.max_batch_seqs", "scheduler.max_batch_tokens",
        "scheduler.prefill_chunk_tokens"}


def _registry_with(key: str, **search) -> list[KnobInfo]:
    return [dataclasses.replace(k, search=dataclasses.replace(k.search, **search)) if k.key == key else k
            for k in knobs()]


def _knob(template_key: str, **fields) -> KnobInfo:
    """A made-up knob, copied from a real one so that it has every field the registry has."""
    template = next(k for k in knobs() if k.key == template_key)
    if "when" in {f.name for f in dataclasses.fields(KnobInfo)}:
        fields.setdefault("when", {})
        fields.setdefault("needs", None)
    return dataclasses.replace(template, **fields)


def _fake_registry() -> list[KnobInfo]:
    """The registry plus a batching mode and a micro-batch size that only counts under 'micro'."""
    return knobs() + [
        _knob("runtime.compute_dtype", area="scheduler", name="batching", default="coalesced",
              choices=("coalesced", "micro"), search=Search(choices=("coalesced", "micro"))),
        _knob("scheduler.max_batch_seqs", name="micro_batch_seqs", default=4, search=Search(low=1, high=16, log=True)),
    ]


MICRO = Condition("scheduler.micro_batch_seqs", "scheduler.batching", ("micro",))


def test_space_is_every_knob_with_a_search_range():
    space = build_space(HW)
    searchable = {k.key for k in knobs() if k.search is not None}
    assert CORE <= set(space.keys) <= searchable
    assert set(space.keys) | set(space.omitted) == searchable  # every searchable knob is accounted for
    assert space.param("scheduler.max_batch_seqs").kind == "int"
    assert space.param("scheduler.max_batch_seqs").log
    assert space.param("runtime.compute_dtype").choices == ("auto", "checkpoint", "float32")
    inert = inert_knobs(HW)
    assert not set(inert) & set(space.keys) and not set(inert) & CORE
    for key in set(inert) & searchable:
        assert "inert" in space.omitted[key]
    # Every condition of a searched knob is on a searched parent sampled before it.
    for i, p in enumerate(space.params):
        for c in p.when:
            assert c.parent in space.keys[:i]


def test_space_hash_is_short_stable_and_changes_with_the_space():
    h = build_space(HW).space_hash()
    assert len(h) == 8 and int(h, 16) >= 0
    assert build_space(HW).space_hash() == h
    # Stable across processes (no salted hashing anywhere).
    out = subprocess.run([sys.executable, "-c", "from tuner.space import build_space; "
                          f"print(build_space({HW!r}).space_hash())"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == h
    assert build_space(HW, registry=_registry_with("scheduler.max_batch_seqs", high=128)).space_hash() != h
    assert build_space(HW, registry=_registry_with("scheduler.max_batch_seqs", log=False)).space_hash() != h
    assert build_space(HW, registry=_registry_with("runtime.compute_dtype",
                                                   choices=("auto", "float32"))).space_hash() != h
    assert build_space(HW, fixed={"scheduler.max_batch_seqs": 8}).space_hash() != h
    assert build_space(HW, inert={**inert_knobs(HW), "scheduler.max_batch_tokens": "test"}).space_hash() != h
    # Thread knobs are searched up to the cores this machine has.
    many = build_space({**HW, "cpu_cores": 64})
    assert many.space_hash() != h
    assert build_space(HW).param("execution.host_expert_threads").high == 2


def test_pinned_and_inert_knobs_leave_the_space():
    space = build_space(HW, fixed={"scheduler.max_batch_seqs": 8},
                        inert={**inert_knobs(HW), "runtime.compute_dtype": "no second precision here"})
    assert set(space.keys) == set(build_space(HW).keys) - {"scheduler.max_batch_seqs", "runtime.compute_dtype"}
    assert "pinned" in space.omitted["scheduler.max_batch_seqs"]
    assert "inert" in space.omitted["runtime.compute_dtype"]
    config = space.to_config({"scheduler.max_batch_tokens": 256, "scheduler.prefill_chunk_tokens": 64},
                             EngineConfig())
    assert config.scheduler.max_batch_seqs == 8
    # An inert rule is a function of the hardware.
    rules = [lambda hw: {} if hw.get("gpu") else {"runtime.compute_dtype": "no GPU"}]
    assert "runtime.compute_dtype" not in build_space({**HW, "gpu": {"name": "x"}}, inert={}).omitted
    assert inert_knobs(HW, rules) == {"runtime.compute_dtype": "no GPU"}
    assert inert_knobs({**HW, "gpu": {"name": "x"}}, rules) == {}


def test_conditional_knob_is_sampled_only_when_its_parent_is_set():
    space = build_space(HW, registry=_fake_registry(), conditions=(MICRO,))
    keys = space.keys
    assert keys.index("scheduler.batching") < keys.index("scheduler.micro_batch_seqs")
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    seen = {"micro": 0, "coalesced": 0}
    for _ in range(30):
        trial = study.ask()
        values = space.sample(trial)
        seen[values["scheduler.batching"]] += 1
        assert ("scheduler.micro_batch_seqs" in values) == (values["scheduler.batching"] == "micro")
        assert space.problems(values) == []
        study.tell(trial, 0.0)
    assert seen["micro"] and seen["coalesced"]
    point = {**build_space(HW).defaults(EngineConfig()), "scheduler.batching": "coalesced"}
    assert space.problems(point) == []
    assert "inactive" in space.problems({**point, "scheduler.micro_batch_seqs": 4})[0]
    assert "missing" in space.problems({**point, "scheduler.batching": "micro"})[0]
    # Pinned parent: the child is searched unconditionally, or not at all.
    on = build_space(HW, registry=_fake_registry(), conditions=(MICRO,), fixed={"scheduler.batching": "micro"})
    assert on.param("scheduler.micro_batch_seqs").when == ()
    off = build_space(HW, registry=_fake_registry(), conditions=(MICRO,),
                      fixed={"scheduler.batching": "coalesced"})
    assert "scheduler.micro_batch_seqs" not in off.keys
    assert "inactive" in off.omitted["scheduler.micro_batch_seqs"]
    assert build_space(HW, registry=_fake_registry(), conditions=(MICRO,)).space_hash() != build_space(
        HW, registry=_fake_registry()).space_hash()


def test_fixed_knobs_are_checked_one_line():
    assert parse_fixed(["max_batch_seqs=8", "runtime.compute_dtype=float32"]) == {
        "scheduler.max_batch_seqs": 8, "runtime.compute_dtype": "float32"}
    for bad, word in [("nope=1", "nope"), ("max_batch_seqs", "KNOB=VALUE"), ("max_batch_seqs=x", "int"),
                      ("compute_dtype=fp8", "compute_dtype"), ("max_batch_seqs=0", "minimum"),
                      ("max_batch_seqs=2000", "max_batch_tokens")]:
        with pytest.raises(ConfigError) as e:
            parse_fixed([bad])
        assert word in str(e.value) and "\n" not in str(e.value)


def test_baselines_are_points_of_the_space_or_left_out():
    space = build_space(HW)
    points = dict((b.name, v) for b, v in baseline_points(space, BaselineContext(hardware=HW)))
    assert {"defaults", "hf-static-like", "llama.cpp-like"} <= set(points)
    assert points["defaults"] == space.defaults(EngineConfig())
    assert points["llama.cpp-like"]["scheduler.max_batch_seqs"] == 1
    for values in points.values():
        assert space.problems(values) == []
        space.to_config(values, EngineConfig())
    # Pinning a knob a baseline sets drops that baseline (it is no longer a point of the space).
    pinned = build_space(HW, fixed={"scheduler.max_batch_seqs": 8})
    names = [b.name for b, _ in baseline_points(pinned, BaselineContext(hardware=HW))]
    assert "defaults" in names and not {"hf-static-like", "llama.cpp-like"} & set(names)
    assert "llama.cpp --cpu-moe" not in names  # places experts between tiers: only where an accelerator exists
    gpu = {**HW, "gpu": {"name": "NVIDIA H200", "count": 1}}
    with_gpu = [b.name for b, _ in baseline_points(build_space(gpu, fixed={"scheduler.max_batch_seqs": 8}),
                                                   BaselineContext(hardware=gpu))]
    assert "llama.cpp --cpu-moe" in with_gpu  # sets only expert knobs, so pinning the batch size keeps it
    # Out of range, or rejected by the engine's cross-field checks: left out.
    odd = [Baseline("huge", "", {"scheduler.max_batch_seqs": 10_000}),
           Baseline("bad-mix", "", {}),
           Baseline("per-model", "", lambda ctx: {"scheduler.max_batch_seqs": ctx.hardware["cpu_cores"]})]
    wide = build_space(HW, registry=_registry_with("scheduler.max_batch_tokens", low=8))
    odd[1] = Baseline("bad-mix", "", {"scheduler.max_batch_seqs": 32, "scheduler.max_batch_tokens": 16})
    assert wide.problems({**wide.defaults(EngineConfig()), **odd[1].values(BaselineContext())}) == []
    skipped: list[tuple[str, str]] = []
    assert [b.name for b, _ in baseline_points(wide, BaselineContext(hardware=HW), odd, skipped)] == ["per-model"]
    # Each baseline left out is said, with why (the command prints them).
    assert [n for n, _ in skipped] == ["huge", "bad-mix"] and all(why for _, why in skipped)
    assert "10000" in skipped[0][1]
    kept = baseline_points(space, BaselineContext(hardware=HW), odd)
    assert [(b.name, v["scheduler.max_batch_seqs"]) for b, v in kept] == [("per-model", 2)]
    assert len({b.name for b in BASELINES}) == len(BASELINES)


@pytest.mark.parametrize(("gpus", "choices"), [(0, None), (1, None), (2, [1, 2]), (3, [1, 2]), (8, [1, 2, 4, 8])])
def test_expert_parallel_ranks_are_searched_up_to_the_gpus_there_are(gpus, choices):
    hw = {**HW, "gpu": {"name": "NVIDIA H200", "count": gpus} if gpus else None}
    space = build_space(hw)
    if choices is None:  # the ranks would share one memory: inert, and its children out with it
        assert "parallel.ep_size" in space.omitted and "parallel.ep_placement" not in space.keys
    else:
        assert list(space.param("parallel.ep_size").choices) == choices
        assert "parallel.ep_placement" in space.keys


def test_only_int4_group_sizes_that_divide_the_model_are_searched():
    # The small preset's expert width is 320: 128 does not divide it (the engine refuses such a config,
    # and a study once spent one trial in ten on it).
    assert list(build_space(HW).param("experts.int4_group_size").choices) == [32, 64, 128]
    assert list(build_space(HW, widths=(1024, 320)).param("experts.int4_group_size").choices) == [32, 64]
    none = build_space(HW, widths=(1024, 100))
    assert "experts.int4_group_size" not in none.keys
    assert "divides the model's widths [1024, 100]" in none.omitted["experts.int4_group_size"]


def test_the_study_space_takes_the_model_widths_from_its_config(tmp_path):
    from engine.model.maker import make_model
    from tuner.cli import model_widths

    make_model(tmp_path / "m", "qwen3_moe", "tiny", seed=1, dtype="float32")
    from engine.model.checkpoint import spec_of

    spec = spec_of(tmp_path / "m")
    assert model_widths(str(tmp_path / "m")) == (spec.hidden_size, spec.expert_intermediate)
    assert model_widths("shape:qwen3-30b-a3b") == (2048, 768)
    assert model_widths(str(tmp_path / "missing")) == ()


def test_the_base_int4_group_fits_the_model_for_a_low_precision_int4_copy():
    from tuner.cli import fit_int4_group

    base = EngineConfig()
    assert fit_int4_group(base, (512, 320)).experts.int4_group_size == 64
    assert fit_int4_group(base, (1024, 768)) is base  # 128 divides both
    assert fit_int4_group(base, ()) is base and fit_int4_group(base, (100,)) is base


def test_a_space_that_can_place_by_hotness_says_so():
    residency = next(k for k in knobs() if k.key == "experts.residency")
    registry = [dataclasses.replace(k, search=Search(choices=("all", "static"))) if k.key == residency.key else k
                for k in knobs()]
    assert build_space(HW, registry=registry).may_place_by_hotness(EngineConfig())
    plain = [dataclasses.replace(k, search=Search(choices=("all", "cache"))) if k.key == residency.key
             else dataclasses.replace(k, search=None) if k.key == "parallel.ep_placement" else k for k in knobs()]
    assert not build_space(HW, registry=plain).may_place_by_hotness(EngineConfig())
    # The start config itself may place by hotness, whatever is searched.
    assert build_space(HW, registry=plain).may_place_by_hotness(EngineConfig().replace(residency="static"))


def test_with_expert_parallelism_searched_no_draw_pairs_it_with_a_hybrid_knob():
    # Each rank runs its experts resident (no hybrid executor): a draw of ep_size 2 with, say, static
    # residency is a config the engine refuses; the space keeps the executor's knobs to one rank.
    space = build_space({**HW, "gpu": {"name": "NVIDIA H200", "count": 2}})
    assert all(any(c.parent == "parallel.ep_size" and c.values == (1,) for c in space.param(k.key).when)
               for k in knobs() if k.executor and k.key in space.keys and k.key not in EP_HONOURS)
    # ...except those expert parallelism honours itself (the SM share: experts vs the combine's collectives)
    assert EP_HONOURS and all(not any(c.parent == "parallel.ep_size" for c in space.param(k).when)
                              for k in EP_HONOURS)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=3))
    ranks = []
    for _ in range(60):
        trial = study.ask()
        try:
            config = space.to_config(space.sample(trial), EngineConfig())
            config.validate()
            ranks.append(config.parallel.ep_size)
        except ConfigError as e:  # other refusals (lo precision equal to hi, ...) are the space's own
            assert "parallel.ep_size" not in str(e)
        study.tell(trial, 0.0)
    assert {1, 2} <= set(ranks)
    # One GPU: nothing conditions on the ranks (the space, and its hash, are as before).
    one = build_space({**HW, "gpu": {"name": "NVIDIA H200", "count": 1}})
    assert not any(c.parent == "parallel.ep_size" for p in one.params for c in p.when)
