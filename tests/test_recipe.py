"""Recipes: paper defaults, validation with clear messages, the fp4_autocast context."""

import pytest

from megatron_fp4.recipe import (FP4Recipe, HiF4BlockScaling, MXFP4BlockScaling, NVFP4BlockScaling1D, fp4_autocast,
                                 get_fp4_recipe, is_fp4_enabled, recipe_for_format)


@pytest.mark.parametrize("cls,name", [(HiF4BlockScaling, "hif4"), (MXFP4BlockScaling, "mxfp4"),
                                      (NVFP4BlockScaling1D, "nvfp4")])
def test_defaults_are_the_paper_setting(cls, name):
    r = cls()
    assert {r.weight_format, r.activation_format, r.gradient_format} == {name}
    assert r.quantize_fprop and r.quantize_dgrad and r.quantize_wgrad
    assert r.gradient_rounding == "nearest" and not r.hadamard_wgrad
    assert r.high_precision_first_layers == 0 and r.high_precision_last_layers == 0
    assert all(r.rounding(role) == "nearest" for role in ("weight", "activation", "gradient"))
    assert r.format("weight").name == name
    assert recipe_for_format(name) == r


@pytest.mark.parametrize("kwargs,match", [
    (dict(weight_format="int4"), "weight_format='int4'.*allowed values"),
    (dict(gradient_rounding="up"), "gradient_rounding='up'.*'nearest', 'stochastic'"),
    (dict(hadamard_block_size=8), "hadamard_block_size=8.*16, 32, 64"),
    (dict(high_precision_first_layers=-1), "high_precision_first_layers=-1"),
    (dict(quantize_dgrad="yes"), "quantize_dgrad='yes'"),
])
def test_validation_names_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HiF4BlockScaling(**kwargs)


def test_mxfp4_rceil_and_bad_scale_mode():
    r = MXFP4BlockScaling(scale_mode="rceil")
    assert r.format("activation").name == "mxfp4_rceil"
    with pytest.raises(ValueError, match="scale_mode='ceil'"):
        MXFP4BlockScaling(scale_mode="ceil")
    with pytest.raises(ValueError, match="format='fp8'"):
        recipe_for_format("fp8")


def test_high_precision_layers():
    r = HiF4BlockScaling(high_precision_first_layers=1, high_precision_last_layers=2)
    assert [r.keeps_layer_in_high_precision(i, 6) for i in range(1, 7)] == [True, False, False, False, True, True]
    with pytest.raises(ValueError):
        r.keeps_layer_in_high_precision(0, 6)


def test_stochastic_only_for_gradients():
    r = HiF4BlockScaling(gradient_rounding="stochastic")
    assert r.rounding("gradient") == "stochastic" and r.rounding("activation") == "nearest"


def test_autocast_nesting():
    assert get_fp4_recipe() is None and not is_fp4_enabled()
    mx = MXFP4BlockScaling()
    with fp4_autocast(recipe=mx):
        assert get_fp4_recipe() is mx
        with fp4_autocast(enabled=False):
            assert get_fp4_recipe() is None
        with fp4_autocast():
            assert isinstance(get_fp4_recipe(), HiF4BlockScaling)
        assert get_fp4_recipe() is mx
    assert get_fp4_recipe() is None
    with pytest.raises(TypeError):
        with fp4_autocast(recipe="hif4"):
            pass
    assert isinstance(HiF4BlockScaling().replace(gradient_rounding="stochastic"), FP4Recipe)
