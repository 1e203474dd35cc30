"""SGLang custom weight loader for refits: load the tensors, then re-quantize the touched FP4 linears once.

Pass ``load_format=REQUANTIZING_LOADER`` to ``Engine.update_weights_from_tensor`` (the engine must list it in
``custom_weight_loader``); :class:`megatron_fp4.rollout.sglang_engine.SGLangRolloutEngine` does both.
"""

from __future__ import annotations

import logging
import time

__all__ = ["REQUANTIZING_LOADER", "load_weights_and_requantize"]

#: Dotted path SGLang's ``dynamic_import`` resolves.
REQUANTIZING_LOADER = "megatron_fp4.sglang_plugin.loader.load_weights_and_requantize"

logger = logging.getLogger(__name__)


def load_weights_and_requantize(model, named_tensors) -> None:
    """``model.load_weights(named_tensors)`` followed by one re-quantization of each stale FP4 linear."""
    from megatron_fp4.sglang_plugin.method import requantize_stale_layers

    t0 = time.perf_counter()
    model.load_weights(named_tensors)
    t1 = time.perf_counter()
    stats = requantize_stale_layers(model)
    logger.info("megatron_fp4 refit: load %.4fs, re-quantized %d linears in %.4fs", t1 - t0, stats["layers"],
                stats["seconds"])
