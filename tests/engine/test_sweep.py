"""``engine sweep``'s values applied to a config (engine/sweep.py)."""

from __future__ import annotations

import pytest

from engine.config import ConfigError, EngineConfig
from engine.model.checkpoint import Checkpoint
from engine.model.maker import make_model
from engine.sweep import _apply


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    """A model whose expert width (96) only the int4 group of 32 divides."""
    d = tmp_path_factory.mktemp("sweep-model")
    make_model(d, "qwen3_moe", "tiny", seed=2, config_overrides=dict(moe_intermediate_size=96))
    return Checkpoint(d).spec


@pytest.mark.parametrize(("knob", "value"), [("hi_precision", "int4"), ("residency", "static:0.001+int4")])
def test_int4_rows_get_a_group_that_divides_the_models_widths(spec, knob, value):
    base = EngineConfig()
    assert base.experts.int4_group_size > 32
    with pytest.raises(ConfigError, match="does not divide the model's"):
        _apply(base, knob, value).validate_for(spec, None)
    cfg = _apply(base, knob, value, spec)
    assert cfg.experts.int4_group_size == 32
    cfg.validate_for(spec, None)


def test_other_rows_keep_the_configured_group(spec):
    base = EngineConfig()
    for knob, value in (("hi_precision", "int8"), ("expert_batching", "micro:4"), ("residency", "static:0.001")):
        assert _apply(base, knob, value, spec).experts.int4_group_size == base.experts.int4_group_size
    assert _apply(base, "expert_batching", "micro:4", spec).execution.micro_batch_tokens == 4
