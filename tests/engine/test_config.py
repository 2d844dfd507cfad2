"""The knob registry: every knob declared once, validated, and reflected in CLI flags and tables."""

from __future__ import annotations

import argparse
import json

import pytest

from engine.config import (
    AREAS,
    ConfigError,
    EngineConfig,
    add_cli_args,
    config_from_args,
    knob_table,
    knobs,
)


def test_every_knob_has_default_doc_and_unique_name():
    names = [k.name for k in knobs()]
    assert len(names) == len(set(names))
    for k in knobs():
        assert k.doc and k.doc.endswith("."), k.key
        assert k.default is not None, k.key
        if k.choices is None and k.type in (int, float):
            assert k.min is not None and k.max is not None, k.key
            assert k.min <= k.default <= k.max, k.key
        if k.search is not None and k.search.choices is None:
            assert k.min <= k.search.low <= k.search.high <= k.max, k.key


def test_defaults_round_trip_and_hash_is_stable():
    cfg = EngineConfig()
    again = EngineConfig.from_dict(cfg.to_dict())
    assert again == cfg
    assert again.config_hash() == cfg.config_hash()
    changed = cfg.replace(max_batch_seqs=8)
    assert changed.scheduler.max_batch_seqs == 8
    assert changed.config_hash() != cfg.config_hash()
    # replace() keeps the knobs it was not asked to change
    assert cfg.replace(compute_dtype="float32").replace(max_batch_seqs=4).runtime.compute_dtype == "float32"


def test_flat_dotted_and_nested_keys_are_accepted():
    a = EngineConfig.from_dict({"max_batch_seqs": 4})
    b = EngineConfig.from_dict({"scheduler.max_batch_seqs": 4})
    c = EngineConfig.from_dict({"scheduler": {"max_batch_seqs": 4}})
    assert a == b == c


@pytest.mark.parametrize(
    "data, needle",
    [
        ({"scheduler": {"max_batch_seqz": 4}}, "unknown key 'scheduler.max_batch_seqz'"),
        ({"bogus": 1}, "unknown key 'bogus'"),
        ({"runtime.max_batch_seqs": 4}, "unknown key 'runtime.max_batch_seqs'"),
        ({"max_batch_seqs": 0}, "scheduler.max_batch_seqs=0: below the minimum 1"),
        ({"max_batch_seqs": 2.5}, "scheduler.max_batch_seqs=2.5: must be int"),
        ({"compute_dtype": "int3"}, "runtime.compute_dtype='int3': must be one of"),
        ({"top_p": 1.5}, "sampling.top_p=1.5: above the maximum 1"),
        ({"ignore_eos": "maybe"}, "sampling.ignore_eos='maybe': must be true or false"),
        ({"max_batch_seqs": 64, "max_batch_tokens": 32}, "max_batch_seqs=64 exceeds scheduler.max_batch_tokens=32"),
        ({"scheduler": 3}, "scheduler=3: expected an object"),
    ],
)
def test_bad_values_are_one_line_errors_naming_key_and_value(data, needle):
    with pytest.raises(ConfigError) as e:
        EngineConfig.from_dict(data, source="c.json")
    msg = str(e.value)
    assert needle in msg
    assert msg.startswith("c.json: ")
    assert "\n" not in msg


def test_config_file_errors_name_the_file(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text("{not json")
    with pytest.raises(ConfigError, match=r"bad.json: not valid JSON \(line 1"):
        EngineConfig.from_file(p)
    p.write_text(json.dumps({"scheduler": {"max_batch_seqs": -1}}))
    with pytest.raises(ConfigError, match="bad.json: scheduler.max_batch_seqs=-1: below the minimum"):
        EngineConfig.from_file(p)
    with pytest.raises(ConfigError, match="no such config file"):
        EngineConfig.from_file(tmp_path / "missing.json")
    # a tuner export wraps the engine config
    p.write_text(json.dumps({"engine_config": {"scheduler": {"max_batch_seqs": 3}}, "model": {}}))
    assert EngineConfig.from_file(p).scheduler.max_batch_seqs == 3


def test_cli_flags_come_from_the_registry():
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    for k in knobs():
        assert k.flag in parser.format_help()
    args = parser.parse_args(["--max-batch-seqs", "6", "--compute-dtype", "float32", "--ignore-eos", "false"])
    cfg = config_from_args(args)
    assert cfg.scheduler.max_batch_seqs == 6
    assert cfg.runtime.compute_dtype == "float32"
    assert cfg.sampling.ignore_eos is False
    with pytest.raises(ConfigError, match="command line: scheduler.max_batch_seqs='x'"):
        config_from_args(parser.parse_args(["--max-batch-seqs", "x"]))


def test_knob_table_lists_every_knob_with_range():
    rows = knob_table()
    assert [r["knob"] for r in rows] == [k.key for k in knobs()]
    assert {r["knob"].split(".")[0] for r in rows} == set(AREAS)
    row = next(r for r in rows if r["knob"] == "scheduler.max_batch_seqs")
    assert row["range"] == "[1, 4096]" and row["search"] == "1..64 log"


def test_search_without_choices_takes_the_literal_choices():
    import typing

    by_key = {k.key: k for k in knobs()}
    for key in ("experts.residency", "execution.missing_expert", "execution.expert_batching",
                "execution.decode_attention", "experts.cache_policy"):
        k = by_key[key]
        assert k.search.choices == k.choices, key
    assert by_key["experts.residency"].search.choices == typing.get_args(
        typing.get_type_hints(AREAS["experts"])["residency"])
    # a subset is still stated where the search is narrower than the type
    assert by_key["runtime.compute_dtype"].search.choices == ("auto", "checkpoint", "float32")


def test_plain_configs_are_derived_from_the_registry():
    from engine.config import departures_from_plain
    from engine.runtime import is_plain

    base = EngineConfig()
    assert departures_from_plain(base) == [] and is_plain(base)
    assert departures_from_plain(base.replace(residency="static")) == ["experts.residency"]
    assert departures_from_plain(base.replace(top_k_override=2, expert_batching="micro")) == [
        "execution.expert_batching", "routing.top_k_override"]
    # knobs the plain engine honours itself, and knobs inactive under their parents, keep it plain
    assert is_plain(base.replace(decode_attention="host"))
    assert is_plain(base.replace(lo_precision="int8", hotness_warmup_tokens=9, micro_batch_tokens=3))
    for knobs_ in (dict(hi_precision="int8"), dict(max_replicas=1), dict(host_expert_threads=1),
                   dict(expert_sm_share=0.5), dict(min_gate_weight=0.1)):
        assert not is_plain(base.replace(**knobs_)), knobs_


def test_one_flat_to_nested_merge():
    from engine.config import merge_flat

    nested = EngineConfig().to_dict()
    merged = merge_flat(nested, {"max_batch_seqs": 3, "runtime.seed": 5, "experts": {"residency": "cache"}})
    assert merged["scheduler"]["max_batch_seqs"] == 3 and merged["runtime"]["seed"] == 5
    assert merged["experts"]["residency"] == "cache" and nested["scheduler"]["max_batch_seqs"] == 32
    with pytest.raises(ConfigError, match="src: unknown key 'bogus'"):
        merge_flat(nested, {"bogus": 1}, "src")


def test_defaults_and_int4_group_sizes_are_stated_once():
    from engine.config import knob_default
    from engine.moe import quant
    from engine.precision import INT4_GROUP_SIZES

    assert knob_default("int4_group_size") == knob_default("experts.int4_group_size") == 128
    assert quant.KERNEL_GROUP_SIZES == INT4_GROUP_SIZES
    k = next(k for k in knobs() if k.name == "int4_group_size")
    assert (k.min, k.max) == (INT4_GROUP_SIZES[0], INT4_GROUP_SIZES[-1])
    with pytest.raises(ConfigError, match=r"int4_group_size=48: must be one of 32, 64, 128, 256"):
        EngineConfig().replace(int4_group_size=48)


def test_dtype_precision_table():
    import torch

    from engine.precision import FLOAT_PRECISIONS, dtype_name, precision_of, torch_dtype

    for p, name in FLOAT_PRECISIONS.items():
        assert torch_dtype(p) is torch_dtype(name) is getattr(torch, name)
        assert precision_of(getattr(torch, name)) == precision_of(name) == p and dtype_name(torch_dtype(p)) == name
    with pytest.raises(ValueError, match="int8"):
        precision_of("int8")


@pytest.mark.parametrize("hi, lo, compute, ok", [
    ("int8", "int4", "auto", True),
    ("auto", "int8", "auto", True),
    ("auto", "bf16", "float32", True),
    ("int4", "int8", "auto", False),   # a tuner trial drew this: the planner raised a ValueError mid-trial
    ("int8", "bf16", "auto", False),
    ("auto", "bf16", "bfloat16", False),
])
def test_the_low_precision_copy_must_be_narrower_than_the_resident_one(hi, lo, compute, ok):
    base = EngineConfig()
    if ok:
        base.replace(hi_precision=hi, lo_precision=lo, compute_dtype=compute, residency="static")
        return
    with pytest.raises(ConfigError, match=f"experts.lo_precision='{lo}' is not narrower than experts.hi_precision='{hi}'"):
        base.replace(hi_precision=hi, lo_precision=lo, compute_dtype=compute, residency="static")
