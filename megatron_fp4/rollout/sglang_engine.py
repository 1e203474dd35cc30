"""The RolloutEngine interface over ``sglang.Engine`` with the megatron-fp4 plug-in (FP4 + Rollout-ResQ).

    engine = SGLangRolloutEngine("/path/to/hf_model", RolloutPrecision("w4a4", "hif4", "2:4"),
                                 device="cpu", attention_backend="torch_native", dtype="float32")
    samples = engine.generate([[1, 5, 9]], SamplingParams(temperature=0.0, max_new_tokens=16))
    stats = engine.update_weights(trainer_model.named_parameters())   # megatron names -> HF, re-quantized, timed
    engine.release_memory(); engine.resume_memory(); engine.shutdown()

Weights travel as full (gathered) tensors: megatron-core names are mapped to HF names/layouts with
:mod:`megatron_fp4.models.hf_conversion` (HF-named tensors pass through), pushed with
``update_weights_from_tensor`` through the plug-in's re-quantizing loader (each touched FP4 linear is quantized
once), in buckets of whole decoder layers, and the prefix cache is flushed. Besides ``stop_token_ids``, SGLang
also stops on the model's EOS ids.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Sequence, Union

import torch

from megatron_fp4.models.hf_conversion import iter_hf_tensors_from_megatron, model_args_from_hf_config
from megatron_fp4.resq import RolloutPrecision
from megatron_fp4.rollout.base import RolloutEngine, RolloutSample, SamplingParams, WeightSyncStats
from megatron_fp4.sglang_plugin.loader import REQUANTIZING_LOADER
from megatron_fp4.sglang_plugin.options import QUANT_METHOD, PluginOptions

__all__ = ["SGLangRolloutEngine", "megatron_to_hf_tensors", "layer_buckets", "check_model_for_precision",
           "sglang_start_problem", "sglang_server_args_fields"]

_HF_PREFIXES = ("model.", "lm_head.")
#: HF linear modules of a transformer block with their K (in_features) source in config.json.
_LINEAR_K = {"self_attn.q_proj": "hidden_size", "self_attn.k_proj": "hidden_size", "self_attn.v_proj": "hidden_size",
             "self_attn.o_proj": "attn_out", "mlp.gate_proj": "hidden_size", "mlp.up_proj": "hidden_size",
             "mlp.down_proj": "intermediate_size"}


def sglang_start_problem(needs_plugin: bool = True) -> Optional[str]:
    """Why an SGLang Engine cannot start in this process for the GRPO driver, or None where it can: it needs a CUDA
    GPU, SGLang and sgl-kernel (SGLang's CUDA ops), and for FP4 rollout (``needs_plugin``) the plug-in's
    ``sglang.srt.plugins`` entry point, which SGLang's scheduler processes load. Imports nothing heavy."""
    import importlib.util
    from importlib.metadata import entry_points

    if not torch.cuda.is_available():
        return ("SGLang's Engine needs a CUDA GPU (its model runner and sgl-kernel's ops are CUDA builds) and "
                "torch.cuda.is_available() is False on this machine")
    for module, what in (("sglang", "SGLang"), ("sgl_kernel", "sgl-kernel (SGLang's CUDA ops)")):
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            return f"{what} is not installed in this environment (see docs/dev/SGLANG.md)"
    if needs_plugin and not any(ep.value.startswith("megatron_fp4.")
                                for ep in entry_points(group="sglang.srt.plugins")):
        return (f"the {QUANT_METHOD} plug-in's 'sglang.srt.plugins' entry point is not installed, so SGLang's "
                f"scheduler cannot load the FP4 rollout method (pip install --no-deps -e . into SGLang's environment, "
                f"or with an offline SGLang bundle: source tools/sglang_bundle_env.sh BUNDLE_DIR)")
    return None


def sglang_server_args_fields() -> Optional[list[str]]:
    """The field names of the installed SGLang's ServerArgs: its constructor's keyword arguments (a dataclass in
    0.5.17, annotated argument groups in 0.5.23); None where SGLang cannot be imported."""
    import inspect

    try:
        from sglang.srt.server_args import ServerArgs
    except Exception:  # noqa: BLE001 (not installed, or broken here: the caller's start check says why)
        return None
    return [n for n, p in inspect.signature(ServerArgs).parameters.items()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


class InMemoryCheckpoint:
    """The slice of MegatronCheckpoint that iter_hf_tensors_from_megatron reads, over megatron-named tensors of the
    model ``hf_config`` describes (whole tensors here; :mod:`megatron_fp4.rollout.tp_group` gathers TP shards)."""

    def __init__(self, tensors: dict[str, torch.Tensor], hf_config: dict) -> None:
        self.tensors, self.model_args = tensors, model_args_from_hf_config(hf_config)
        self.args = {"hf_vocab_size": int(hf_config["vocab_size"])}

    def full_tensor(self, name: str) -> torch.Tensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"update_weights: megatron tensor {name!r} is missing (pass the full model's gathered "
                           f"parameters)") from None


def iter_megatron_to_hf(named_tensors: Iterable[tuple[str, torch.Tensor]], hf_config: dict
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs for gathered megatron-core tensors, made one at a time; HF-named inputs pass
    through unchanged, also one at a time (a generator of them is not materialized)."""
    it = iter(named_tensors)
    first = next(it, None)
    if first is None:
        return
    if first[0].startswith(_HF_PREFIXES):
        for n, t in itertools.chain([first], it):
            if not n.startswith(_HF_PREFIXES):
                raise ValueError(f"update_weights: mixed HF ({first[0]!r}) and megatron ({n!r}) names; give one kind")
            yield n, t.detach()
        return
    items = [(n, t.detach()) for n, t in itertools.chain([first], it)]  # references, for lookup by name
    hf_named = [n for n, _ in items if n.startswith(_HF_PREFIXES)]
    if hf_named:
        raise ValueError(f"update_weights: mixed HF ({hf_named[0]!r}) and megatron names; give one kind")
    yield from iter_hf_tensors_from_megatron(InMemoryCheckpoint(dict(items), hf_config))


def megatron_to_hf_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]], hf_config: dict
                           ) -> list[tuple[str, torch.Tensor]]:
    """:func:`iter_megatron_to_hf` as a list."""
    return list(iter_megatron_to_hf(named_tensors, hf_config))


def _layer_key(hf_name: str) -> str:
    """``model.layers.7`` for a decoder layer's tensor, the name itself otherwise."""
    parts = hf_name.split(".")
    return ".".join(parts[:3]) if parts[:2] == ["model", "layers"] else hf_name


def layer_buckets(hf_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
                  ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``hf_tensors`` in order, cut into pushes of about ``bucket_bytes``: never inside a decoder layer (SGLang
    fuses q/k/v and gate/up, and the plug-in re-quantizes a linear at each load that touches it), so a bucket
    may exceed ``bucket_bytes`` by one layer. Lazy: one bucket is held at a time."""
    current: list[tuple[str, torch.Tensor]] = []
    size, key = 0, None
    for name, t in hf_tensors:
        k = _layer_key(name)
        if k != key and current and size >= bucket_bytes:
            yield current
            current, size = [], 0
        key = k
        current.append((name, t))
        size += t.numel() * t.element_size()
    if current:
        yield current


def check_model_for_precision(hf_config: dict, precision: RolloutPrecision, tp_size: int = 1) -> None:
    """Fail fast (naming the option) when ``precision`` cannot serve this model: bad format/sparsity/mode, or a
    linear whose in_features per tensor-parallel rank is not a whole number of the format's blocks."""
    if precision.mode == "bf16":
        return
    opts = PluginOptions.from_precision(precision)
    heads = int(hf_config["num_attention_heads"])
    head_dim = int(hf_config.get("head_dim") or int(hf_config["hidden_size"]) // heads)
    widths = {"hidden_size": int(hf_config["hidden_size"]), "attn_out": heads * head_dim,
              "intermediate_size": int(hf_config["intermediate_size"])}
    for module, key in _LINEAR_K.items():
        row_parallel = module.endswith(("o_proj", "down_proj"))
        k = widths[key] // tp_size if row_parallel else widths[key]
        opts.check_linear(f"model.layers.*.{module}", k)


class SGLangRolloutEngine(RolloutEngine):
    """Rollout through an in-process ``sglang.Engine`` serving an HF model folder in a rollout precision."""

    def __init__(self, model_path: Union[str, os.PathLike], precision: RolloutPrecision = RolloutPrecision(),
                 *, device: Optional[str] = None, tp_size: int = 1, enable_memory_saver: Optional[bool] = None,
                 weight_bucket_bytes: int = 512 * 2**20, **engine_kwargs: Any) -> None:
        """``model_path``: HF folder (config.json, weights). ``precision``: "bf16" serves the model unquantized;
        other modes use the ``megatron_fp4`` quantization method. ``device="cpu"`` wants
        ``attention_backend="torch_native"``; ``weight_bucket_bytes``: the size of each push of
        :meth:`update_weights`; other keyword arguments go to ``sglang.Engine`` (see :meth:`engine_args`)."""
        if weight_bucket_bytes < 1:
            raise ValueError(f"weight_bucket_bytes={weight_bucket_bytes!r} must be >= 1")
        self.weight_bucket_bytes = weight_bucket_bytes
        self.model_path = str(model_path)
        self.hf_config = json.loads((Path(model_path) / "config.json").read_text())
        kwargs = self.engine_args(model_path, precision, device=device, tp_size=tp_size,
                                  enable_memory_saver=enable_memory_saver, **engine_kwargs)  # validates first
        self._precision = precision
        self._memory_saver = bool(kwargs.get("enable_memory_saver"))
        if device == "cpu":
            os.environ["SGLANG_USE_CPU_ENGINE"] = "1"  # SGLang's CPU switch (read by its processes at import)
        self.engine = self._launch(kwargs)
        self._released = False
        self.last_weight_sync: Optional[WeightSyncStats] = None
        self.last_generate_stats: dict[str, float] = {}

    @staticmethod
    def _launch(kwargs: dict[str, Any]) -> Any:
        """Start ``sglang.Engine(**kwargs)`` with the plug-in registered in this process too (SGLang's own
        processes load it through its entry point)."""
        import sglang as sgl

        from megatron_fp4.sglang_plugin import register

        register()
        return sgl.Engine(**kwargs)

    @staticmethod
    def engine_args(model_path: Union[str, os.PathLike], precision: RolloutPrecision = RolloutPrecision(), *,
                    dtype: str = "bfloat16", device: Optional[str] = None, tp_size: int = 1,
                    random_seed: int = 0, enable_memory_saver: Optional[bool] = None, log_level: str = "error",
                    **engine_kwargs: Any) -> dict[str, Any]:
        """The ``sglang.Engine`` keyword arguments serving ``model_path`` in ``precision`` (token ids in and out,
        the re-quantizing refit loader, the ``megatron_fp4`` method and its options); validates them first."""
        if not isinstance(precision, RolloutPrecision):
            raise TypeError(f"precision must be a RolloutPrecision, got {type(precision).__name__}")
        hf_config = json.loads((Path(model_path) / "config.json").read_text())
        check_model_for_precision(hf_config, precision, tp_size)  # before any process starts
        kwargs: dict[str, Any] = dict(model_path=str(model_path), dtype=dtype, tp_size=tp_size,
                                      random_seed=random_seed, log_level=log_level, skip_tokenizer_init=True,
                                      custom_weight_loader=[REQUANTIZING_LOADER])
        if device is not None:
            kwargs["device"] = device
        on_gpu = (device or "cuda") != "cpu"
        if (on_gpu if enable_memory_saver is None else enable_memory_saver):
            kwargs["enable_memory_saver"] = True  # release/resume of weights and KV cache (torch_memory_saver)
        overrides = json.loads(engine_kwargs.pop("json_model_override_args", None) or "{}")
        if precision.mode != "bf16":
            kwargs["quantization"] = QUANT_METHOD
            overrides["quantization_config"] = PluginOptions.from_precision(precision).to_quant_config()
        if overrides:
            kwargs["json_model_override_args"] = json.dumps(overrides)
        kwargs.update(engine_kwargs)
        return kwargs

    @property
    def precision(self) -> RolloutPrecision:
        """The rollout precision the engine serves (fixed at start)."""
        return self._precision

    # -- generation ----------------------------------------------------------------------------------------------------
    @staticmethod
    def _sampling_dict(p: SamplingParams) -> dict:
        d = {"temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k if p.top_k > 0 else -1,
             "max_new_tokens": p.max_new_tokens, "stop_token_ids": list(p.stop_token_ids)}
        if p.seed is not None:
            d["sampling_seed"] = int(p.seed)
        return d

    def generate(self, prompts: Sequence[Sequence[int]], sampling_params: SamplingParams = SamplingParams()
                 ) -> list[RolloutSample]:
        """One response per prompt, with the per-token logprobs SGLang computed while sampling."""
        if self._released:
            raise RuntimeError("generate() after release_memory(); call resume_memory() first")
        prompts = [[int(t) for t in p] for p in prompts]
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        if not prompts:
            return []
        t0 = time.perf_counter()
        sp = self._sampling_dict(sampling_params)
        outs = self.engine.generate(input_ids=prompts, sampling_params=[dict(sp) for _ in prompts],
                                    return_logprob=True)
        results = []
        for p, out in zip(prompts, outs):
            meta = out["meta_info"]
            lps = meta.get("output_token_logprobs") or []
            ids = [int(t[1]) for t in lps] if lps else list(out.get("output_ids", []))
            fr = meta.get("finish_reason") or {}
            kind = fr.get("type") if isinstance(fr, dict) else str(fr)
            if kind == "abort":
                raise RuntimeError(f"SGLang aborted a request: {fr.get('message', fr)}")
            finish = "stop" if kind == "stop" else "length"
            results.append(RolloutSample(token_ids=ids, logprobs=[float(t[0]) for t in lps], finish_reason=finish,
                                         prompt_length=len(p)))
        seconds = time.perf_counter() - t0
        n = sum(len(r.token_ids) for r in results)
        self.last_generate_stats = {"samples": len(results), "generated_tokens": n, "seconds": seconds,
                                    "tokens_per_s": n / seconds if seconds > 0 else 0.0}
        return results

    # -- weights and memory ----------------------------------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> WeightSyncStats:
        """Push gathered trainer tensors (megatron-core or HF names) into SGLang, in buckets of whole decoder layers
        of about ``weight_bucket_bytes`` (so each FP4 linear is re-quantized once, on load, and only one bucket of
        HF-layout copies exists at a time); then the prefix cache is flushed."""
        t0 = time.perf_counter()
        stats = WeightSyncStats()
        load_s, n = 0.0, 0
        for bucket in layer_buckets(iter_megatron_to_hf(named_tensors, self.hf_config), self.weight_bucket_bytes):
            t1 = time.perf_counter()
            ok, msg = self.engine.update_weights_from_tensor(bucket, load_format=REQUANTIZING_LOADER,
                                                             flush_cache=False)
            load_s += time.perf_counter() - t1
            n += 1
            if not ok:
                raise RuntimeError(f"SGLang update_weights_from_tensor failed (bucket {n}, from {bucket[0][0]}): "
                                   f"{msg}")
            stats.num_tensors += len(bucket)
            stats.num_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
        self.engine.flush_cache()  # cached prefixes were computed with the old weights
        stats.total_seconds = time.perf_counter() - t0
        stats.copy_seconds = stats.total_seconds - load_s  # megatron -> HF mapping (and the cache flush)
        stats.quantize_seconds = 0.0          # inside SGLang's load (total_seconds covers it; see the log line)
        stats.extra.update(sglang_load_seconds=load_s, buckets=n)
        self.last_weight_sync = stats
        return stats

    def flush_cache(self) -> None:
        """Drop SGLang's prefix (radix) cache."""
        self.engine.flush_cache()

    def release_memory(self) -> None:
        """Release SGLang's KV cache and weights (GPU memory saver); on CPU only the cache is flushed."""
        if self._memory_saver:
            self.engine.release_memory_occupation()
        else:
            self.engine.flush_cache()
        self._released = True

    def resume_memory(self) -> None:
        """Undo :meth:`release_memory`; push weights again afterwards if the memory saver dropped them."""
        if self._memory_saver and self._released:
            self.engine.resume_memory_occupation()
        self._released = False

    def shutdown(self) -> None:
        """Stop SGLang's processes."""
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            engine.shutdown()

    def __enter__(self) -> "SGLangRolloutEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
