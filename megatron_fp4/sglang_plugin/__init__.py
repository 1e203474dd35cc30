"""SGLang plug-in: the ``megatron_fp4`` quantization method (HiF4 / MXFP4 FP4 rollout with Rollout-ResQ).

Installed with ``pip install -e .[sglang]``; SGLang finds it through the ``sglang.srt.plugins`` entry point
``megatron_fp4 = megatron_fp4.sglang_plugin:register`` (run in every SGLang process), which adds the method to
SGLang's quantization registry and ``--quantization`` choices. Select it with ``quantization="megatron_fp4"``
and a ``quantization_config`` (in config.json, or ``json_model_override_args``), see
:mod:`megatron_fp4.sglang_plugin.options`. :mod:`options` needs no SGLang; the rest imports it. At W4A4 + ResQ 2:4
(bf16 sum) the norms and SwiGLUs before the FP4 linears make their operands (:mod:`.fused`).
"""

from __future__ import annotations

from megatron_fp4.sglang_plugin.options import QUANT_METHOD, PluginOptions, quant_config_dict

__all__ = ["QUANT_METHOD", "PluginOptions", "quant_config_dict", "register", "is_registered",
           "quantization_choices"]

#: Where SGLang keeps its ``--quantization`` choices: its newer releases (0.5.23) moved them to
#: ``sglang.srt.arg_groups.choices`` (``server_args`` re-exports them); 0.5.17 defines them in ``server_args``.
_CHOICES_MODULES = ("sglang.srt.arg_groups.choices", "sglang.srt.server_args")


def quantization_choices():
    """SGLang's ``--quantization`` choice list and its ``add_quantization_method_choices``, from whichever module
    of :data:`_CHOICES_MODULES` this SGLang has (the first that exists)."""
    import importlib

    for name in _CHOICES_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name is None or not (name == e.name or name.startswith(e.name + ".")):
                raise  # the module exists but something it imports is missing: a broken install, not a layout
            continue
        if hasattr(module, "QUANTIZATION_CHOICES") and hasattr(module, "add_quantization_method_choices"):
            return module.QUANTIZATION_CHOICES, module.add_quantization_method_choices
    raise ImportError(f"this SGLang has no QUANTIZATION_CHOICES/add_quantization_method_choices in any of "
                      f"{', '.join(_CHOICES_MODULES)}; megatron_fp4 supports SGLang 0.5.17 and 0.5.23")


def register() -> None:
    """Add ``megatron_fp4`` to SGLang's quantization methods and CLI choices (idempotent)."""
    from sglang.srt.layers import quantization as sgl_quant

    from megatron_fp4.sglang_plugin.method import MegatronFP4Config

    sgl_quant.QUANTIZATION_METHODS[QUANT_METHOD] = MegatronFP4Config
    sgl_quant.BASE_QUANTIZATION_METHODS[QUANT_METHOD] = MegatronFP4Config
    # SGLang's CPU engine on AMX machines only accepts methods listed here (the PyTorch reference serves CPU).
    getattr(sgl_quant, "CPU_QUANTIZATION_METHODS", {})[QUANT_METHOD] = MegatronFP4Config
    choices, add_choices = quantization_choices()
    if QUANT_METHOD not in choices:
        add_choices([QUANT_METHOD])


def is_registered() -> bool:
    """Whether SGLang's registry (in this process) knows the ``megatron_fp4`` method."""
    from sglang.srt.layers import quantization as sgl_quant

    return QUANT_METHOD in sgl_quant.QUANTIZATION_METHODS
