"""The native (in-process) rollout engine: KV-cached batched generation on the trainer's megatron-core GPTModel.

    engine = NativeRolloutEngine(model, RolloutPrecision("w4a4", "hif4", "2:4"))
    samples = engine.generate([[1, 5, 9], [1, 7]], SamplingParams(temperature=1.0, max_new_tokens=32, seed=0))
    stats = engine.update_weights(trainer_model.named_parameters())   # re-quantizes once, timed

Generation uses megatron-core's ``StaticInferenceContext`` (the KV cache of ``GPTModel.forward``): one prefill of
all prompts, left-padded to the longest and with the padding masked out of attention (``prefill="padded"``, the
default; RoPE only sees relative positions), then one token per step for the whole batch. ``prefill="aligned"``
instead prefills the shortest prompt length and feeds longer prompts token by token (no padding anywhere).
Finished rows are dropped from the batch and the KV cache is compacted. Pad tokens pass through the linears:
they do not change token-local rollout forms, but they take part in the ResQ "channel"/"tile32x64" selection
(and in :class:`~megatron_fp4.rollout.RolloutUnderflowMonitor` counts). The transformer-layer linears compute
the configured rollout precision (see :mod:`megatron_fp4.rollout.precision`); the training recipe does not apply.
"""

from __future__ import annotations

import os
import time
from typing import Iterable, Optional, Sequence

import torch
from megatron.core.inference.contexts import StaticInferenceContext

from megatron_fp4.kernels._common import pdl_enabled
from megatron_fp4.ops import warn_reference_fallback
from megatron_fp4.resq import RolloutPrecision, rollout_backend_for
from megatron_fp4.rollout_kernels import register_kernel_backend
from megatron_fp4.rollout.base import RolloutEngine, RolloutSample, SamplingParams, WeightSyncStats
from megatron_fp4.rollout.precision import (
    get_weight_cache,
    quantized_weights,
    rollout_linear_modules,
    rollout_precision,
)
from megatron_fp4.rollout.static_decode import (
    StaticCacheGenerator,
    precision_is_token_local,
    static_decode_support,
)
from megatron_fp4.rollout.sampling import sample_tokens, token_logprobs

__all__ = ["NativeRolloutEngine", "teacher_forced_logprobs", "full_forward_logits", "DECODE_MODES"]

#: Generation paths of :class:`NativeRolloutEngine` (its ``decode`` argument).
DECODE_MODES = ("megatron", "static", "graph", "auto")


def _model_device(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _check_prompts(prompts: Sequence[Sequence[int]], vocab_size: Optional[int]) -> list[list[int]]:
    out = []
    for i, p in enumerate(prompts):
        p = [int(t) for t in p]
        if not p:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        if vocab_size is not None and (min(p) < 0 or max(p) >= vocab_size):
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab_size})")
        out.append(p)
    return out


def full_forward_logits(model: torch.nn.Module, sequences: Sequence[Sequence[int]], pad_token_id: int = 0
                        ) -> torch.Tensor:
    """fp32 logits ``[B, S, V]`` of a causal full-sequence forward (right-padded batch, no KV cache)."""
    device = _model_device(model)
    S = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), S), pad_token_id, dtype=torch.long, device=device)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long, device=device)
    pos = torch.arange(S, device=device).unsqueeze(0).expand(len(sequences), -1)
    return model(ids, pos, None, runtime_gather_output=True).float()


@torch.no_grad()
def teacher_forced_logprobs(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    precision: RolloutPrecision = RolloutPrecision(),
    temperature: float = 1.0,
) -> list[list[float]]:
    """Logprobs of ``responses`` given ``prompts`` from one full forward of ``model`` in rollout ``precision``.

    The same quantity the engine reports (log_softmax(logits / T); T = 1 for greedy); with a token-local rollout
    form (all but ResQ "channel"/"tile32x64") it matches the engine's numbers up to fp32 rounding.
    """
    was_training = model.training
    model.eval()
    try:
        with rollout_precision(model, precision):
            seqs = [list(p) + list(r) for p, r in zip(prompts, responses)]
            logits = full_forward_logits(model, seqs)
    finally:
        model.train(was_training)
    out = []
    for i, (p, r) in enumerate(zip(prompts, responses)):
        if not r:
            out.append([])
            continue
        lp = logits[i, len(p) - 1: len(p) - 1 + len(r)]
        toks = torch.tensor(list(r), dtype=torch.long, device=lp.device)
        out.append(token_logprobs(lp, toks, temperature).tolist())
    return out


class NativeRolloutEngine(RolloutEngine):
    """KV-cached batched generation on a megatron-core GPTModel in a configurable rollout precision."""

    def __init__(
        self,
        model: torch.nn.Module,
        precision: RolloutPrecision = RolloutPrecision(),
        *,
        max_batch_size: Optional[int] = None,
        max_seq_len: Optional[int] = None,
        pad_token_id: int = 0,
        offload_on_release: bool = False,
        prefill: str = "padded",
        decode: Optional[str] = None,
        graph_chunk: int = 16,
    ) -> None:
        """``model``: a GPTModel holding the whole model (tensor parallel is fine; a pipeline stage is not: under
        pipeline parallelism give every rank a full-depth copy built with ``pipeline_model_parallel_size=1`` and
        feed it the stages' weights gathered by :func:`megatron_fp4.models.pp_gather.gather_pipeline_parameters`).
        ``max_batch_size``: prompts per forward (None: all at once). ``max_seq_len``: prompt + response cap
        (default: the model's max sequence length; with ``prefill="padded"`` it caps the padded length).
        ``offload_on_release``: move the weights to the CPU in :meth:`release_memory` (only for a model the
        engine owns, not one shared with the trainer).
        ``prefill``: "padded" (one prefill of all prompts, left padding masked) or "aligned" (prefill of the
        shortest prompt length, longer prompts fed one token per step; no padding at all).
        ``decode``: "megatron" (the reference: megatron-core's forward with its KV cache, as before), "static"
        (:mod:`megatron_fp4.rollout.static_decode`: static KV cache, SDPA prefill, eager decode steps), "graph"
        (the same with each decode step a CUDA-graph replay; CUDA only) or "auto" ("graph" on CUDA, "megatron"
        elsewhere); None reads ``MEGATRON_FP4_ROLLOUT_DECODE`` (default "megatron"). The static paths serve
        token-local precisions (all but ResQ "channel"/"tile32x64") on supported models without forward hooks;
        other calls take the megatron path. On them ``max_batch_size`` caps the concurrent sequences, finished
        ones being replaced by waiting prompts, and ``graph_chunk`` decode steps run between host checks.
        On CUDA the Triton kernel backend is registered for the rollout GEMMs it covers (``MEGATRON_FP4_KERNELS=0``
        keeps the PyTorch reference)."""
        if not (getattr(model, "pre_process", True) and getattr(model, "post_process", True)):
            raise NotImplementedError("NativeRolloutEngine needs the whole model on one rank, not a pipeline "
                                      "stage: build a full-depth copy (see megatron_fp4.models.pp_gather)")
        if prefill not in ("padded", "aligned"):
            raise ValueError(f"prefill={prefill!r} is not valid; allowed values: 'padded', 'aligned'")
        self.prefill = prefill
        if decode is None:
            decode = os.environ.get("MEGATRON_FP4_ROLLOUT_DECODE", "megatron") or "megatron"
        if decode not in DECODE_MODES:
            raise ValueError(f"decode={decode!r} is not valid; allowed values: "
                             f"{', '.join(map(repr, DECODE_MODES))}")
        if graph_chunk < 1:
            raise ValueError(f"graph_chunk={graph_chunk!r} must be >= 1")
        self.graph_chunk = graph_chunk
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size!r} must be >= 1 or None")
        self.model = model
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len or getattr(model, "max_sequence_length", None)
        if self.max_seq_len is None:
            raise ValueError("max_seq_len is required when the model does not define max_sequence_length")
        self.pad_token_id = pad_token_id
        self.offload_on_release = offload_on_release
        self.vocab_size = getattr(model, "vocab_size", None)
        self._precision = precision
        self._offloaded_device: Optional[torch.device] = None
        device = _model_device(model)
        if decode == "auto":
            decode = "graph" if device.type == "cuda" else "megatron"
        if decode == "graph" and device.type != "cuda":
            raise ValueError("decode='graph' needs the model on a CUDA device; use 'static' or 'megatron'")
        self.decode = decode
        self._static: Optional[StaticCacheGenerator] = None
        if decode in ("static", "graph"):
            why = static_decode_support(model)
            if why is not None:
                raise ValueError(f"decode={decode!r} cannot run this model ({why}); use 'megatron' or 'auto'")
            self._static = StaticCacheGenerator(model)
        if device.type == "cuda" and rollout_backend_for("cuda") is None:
            if os.environ.get("MEGATRON_FP4_KERNELS", "1") == "0":
                warn_reference_fallback("rollout FP4 GEMMs", "cuda", "MEGATRON_FP4_KERNELS=0")
            elif not register_kernel_backend("cuda"):  # Triton FP4 GEMMs where they apply (the reference's numbers)
                warn_reference_fallback("rollout FP4 GEMMs", "cuda", "Triton or the kernels cannot run here")
        #: Statistics of the last generate() and update_weights() calls.
        self.last_generate_stats: dict[str, float] = {}
        self.last_weight_sync: Optional[WeightSyncStats] = None
        self.set_precision(precision)

    # -- configuration -----------------------------------------------------------------------------------------------
    @property
    def precision(self) -> RolloutPrecision:
        """The rollout precision generate() uses."""
        return self._precision

    @property
    def weight_cache(self):
        """The model's quantized-weight cache."""
        return get_weight_cache(self.model)

    def set_precision(self, precision: RolloutPrecision) -> float:
        """Switch the rollout precision; quantizes the weights now if it needs FP4 weights. Returns seconds."""
        if not isinstance(precision, RolloutPrecision):
            raise TypeError(f"precision must be a RolloutPrecision, got {type(precision).__name__}")
        self._precision = precision
        self.weight_cache.clear()
        if self._static is not None:
            self._static.invalidate()
        return self._quantize_weights()

    def _quantize_weights(self, in_place: bool = False) -> float:
        if not self._precision.quantize_weights:
            return 0.0
        return self.weight_cache.refresh(quantized_weights(self.model), self._precision.format, self._precision,
                                         in_place=in_place)

    # -- weights and memory ----------------------------------------------------------------------------------------
    def update_weights(self, named_tensors: Optional[Iterable[tuple[str, torch.Tensor]]]) -> WeightSyncStats:
        """Copy trainer tensors (megatron-core names) into the model, then re-quantize once; returns timings.

        ``None`` means the model's parameters were already updated in place (a model shared with the trainer):
        only the re-quantization runs.
        """
        t0 = time.perf_counter()
        stats = WeightSyncStats()
        if named_tensors is not None:
            params = dict(self.model.named_parameters())
            with torch.no_grad():
                for name, tensor in named_tensors:
                    if name not in params:
                        raise KeyError(f"update_weights: unknown parameter {name!r}; the model has e.g. "
                                       f"{', '.join(list(params)[:4])}")
                    p = params[name]
                    if tuple(tensor.shape) != tuple(p.shape):
                        raise ValueError(f"update_weights: {name} has shape {tuple(tensor.shape)}, "
                                         f"the model expects {tuple(p.shape)}")
                    if tensor is not p:
                        p.copy_(tensor.detach())
                    stats.num_tensors += 1
                    stats.num_bytes += tensor.numel() * tensor.element_size()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        t1 = time.perf_counter()
        if self._static is not None and self._static.has_graphs:
            # captured decode graphs read the prepared weights: rewrite them in place so the graphs stay valid
            stats.quantize_seconds = self._quantize_weights(in_place=True)
            if not self.weight_cache.last_refresh_in_place:
                self._static.invalidate()
        else:
            self.weight_cache.clear()
            stats.quantize_seconds = self._quantize_weights()
        stats.copy_seconds = t1 - t0
        stats.total_seconds = time.perf_counter() - t0
        stats.extra["quantized_weights"] = len(self.weight_cache)
        self.last_weight_sync = stats
        return stats

    def release_memory(self) -> None:
        """Drop the quantized weights, the static paths' KV cache and CUDA graphs (the megatron path's cache lives
        only inside generate); offload weights if configured."""
        self.weight_cache.clear()
        if self._static is not None:
            self._static.reset()  # the KV cache and the graphs
        if self.offload_on_release:
            device = _model_device(self.model)
            if device.type != "cpu":
                self._offloaded_device = device
                self.model.to("cpu")
                torch.cuda.empty_cache()

    def resume_memory(self) -> None:
        """Bring offloaded weights back and re-quantize them."""
        if self._offloaded_device is not None:
            self.model.to(self._offloaded_device)
            self._offloaded_device = None
        if len(self.weight_cache) == 0:
            self._quantize_weights()

    def measure_underflow(self, prompts: Sequence[Sequence[int]], sampling_params: SamplingParams,
                          sparsity: str = "2:4") -> dict[str, dict[str, float]]:
        """Generate once with per-layer underflow counting: {linear name: {"fp4": rate, "resq": rate}} in the
        engine's format, without and with a ResQ ``sparsity`` residual (see RolloutUnderflowMonitor)."""
        from megatron_fp4.rollout.diagnostics import RolloutUnderflowMonitor

        with RolloutUnderflowMonitor(self.model, self._precision.format, sparsity) as monitor:
            self.generate(prompts, sampling_params)
        return monitor.collect()

    # -- generation ----------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], sampling_params: SamplingParams = SamplingParams()
                 ) -> list[RolloutSample]:
        """One response per prompt: token ids, logprobs of the sampled tokens, finish reason."""
        prompts = _check_prompts(prompts, self.vocab_size)
        if not prompts:
            return []
        too_long = [i for i, p in enumerate(prompts) if len(p) >= self.max_seq_len]
        if too_long:
            raise ValueError(f"prompts {too_long[:8]} are at least max_seq_len={self.max_seq_len} tokens long")
        if self._offloaded_device is not None:
            raise RuntimeError("generate() after release_memory(); call resume_memory() first")
        generator = None
        device = _model_device(self.model)
        if sampling_params.seed is not None:
            generator = torch.Generator(device=device).manual_seed(sampling_params.seed)
        t0 = time.perf_counter()
        was_training = self.model.training
        self.model.eval()
        results: list[RolloutSample] = []
        steps = 0
        path = self._path()
        try:
            if path != "megatron":
                results, steps = self._static.generate(
                    prompts, sampling_params, self._precision, self.weight_cache, self.max_seq_len,
                    use_graphs=path == "graph", max_concurrent=self.max_batch_size, chunk=self.graph_chunk,
                    generator=generator)
            else:
                with rollout_precision(self.model, self._precision):
                    bs = self.max_batch_size or len(prompts)
                    for start in range(0, len(prompts), bs):
                        chunk, n = self._generate_batch(prompts[start:start + bs], sampling_params, generator,
                                                        device)
                        results.extend(chunk)
                        steps += n
        finally:
            self.model.train(was_training)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        n_tokens = sum(len(r.token_ids) for r in results)
        self.last_generate_stats = {
            "samples": len(results), "generated_tokens": n_tokens, "seconds": seconds,
            "tokens_per_s": n_tokens / seconds if seconds > 0 else 0.0, "forward_steps": steps, "path": path,
        }
        if path != "megatron":
            self.last_generate_stats.update(self._static.last_stats)
            if self._static.fused:  # megatron_fp4/kernels/decode_ops.py's fused decode-step kernels (the GPU default)
                path += "+fused"
                if pdl_enabled():  # the step's kernels with programmatic dependent launch (MEGATRON_FP4_PDL=1)
                    path += "+pdl"
                self.last_generate_stats["path"] = path
        return results

    @torch.no_grad()
    def forced_logprobs(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                        temperature: float = 1.0) -> list[list[float]]:
        """Logprobs of given non-empty ``responses`` (log_softmax(logits / T); T = 1 when 0) computed by the path
        :meth:`generate` takes, teacher-forced token by token: on the static / graph paths the decode steps
        themselves (to compare them with the megatron reference on the same tokens); on the megatron path one
        full forward (:func:`teacher_forced_logprobs`)."""
        prompts = _check_prompts(prompts, self.vocab_size)
        path = self._path()
        if path == "megatron":
            return teacher_forced_logprobs(self.model, prompts, responses, self._precision, temperature)
        params = SamplingParams(temperature=temperature, max_new_tokens=max(len(r) for r in responses))
        was_training = self.model.training
        self.model.eval()
        try:
            samples, _ = self._static.generate(prompts, params, self._precision, self.weight_cache,
                                               self.max_seq_len, use_graphs=path == "graph",
                                               max_concurrent=self.max_batch_size, chunk=self.graph_chunk,
                                               forced=responses)
        finally:
            self.model.train(was_training)
        return [s.logprobs for s in samples]

    def _path(self) -> str:
        """Which generation path serves the next call: the configured static one where it applies, else megatron."""
        if self._static is None or not precision_is_token_local(self._precision):
            return "megatron"
        if any(m._forward_pre_hooks or m._forward_hooks for m in rollout_linear_modules(self.model).values()):
            return "megatron"  # e.g. RolloutUnderflowMonitor counts inputs in module hooks
        return self.decode

    def _forward(self, ids: torch.Tensor, start: int, ctx: StaticInferenceContext,
                 mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits [B, V] (fp32) of the last position for tokens ``ids [B, L]`` at cache positions start.. ;
        ``mask`` (bool, True = masked) ``[B, 1, L, start + L]`` hides left padding."""
        pos = torch.arange(start, start + ids.shape[1], device=ids.device).unsqueeze(0).expand(ids.shape[0], -1)
        logits = self.model(ids, pos, mask, inference_context=ctx, runtime_gather_output=True)
        return logits[:, -1].float()

    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams,
                        generator: Optional[torch.Generator], device: torch.device
                        ) -> tuple[list[RolloutSample], int]:
        B = len(prompts)
        lens = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=device)
        lmax = int(lens.max())
        total = min(lmax + params.max_new_tokens, self.max_seq_len)
        padded = self.prefill == "padded"
        # "padded": prompts right-aligned at lmax (left padding masked out; RoPE is relative, so a shift of a whole
        # sequence changes nothing); "aligned": prompts start at 0 and longer ones are fed token by token.
        pads = (lmax - lens) if padded else torch.zeros_like(lens)
        tokens = torch.full((B, total), self.pad_token_id, dtype=torch.long, device=device)
        for i, p in enumerate(prompts):
            o = int(pads[i])
            tokens[i, o:o + len(p)] = torch.tensor(p, dtype=torch.long, device=device)
        ends = pads + lens  # first generated position of each row
        logprobs = torch.zeros((B, total), dtype=torch.float32, device=device)
        n_gen = torch.zeros(B, dtype=torch.long, device=device)
        finish = ["length"] * B
        stop_ids = torch.tensor(params.stop_token_ids or [-1], dtype=torch.long, device=device)
        use_mask = bool((pads > 0).any())

        ctx = StaticInferenceContext(B, total)
        t = lmax if padded else int(lens.min())
        mask = None
        if use_mask:
            ar = torch.arange(t, device=device)
            causal = ar.unsqueeze(0) > ar.unsqueeze(1)  # [q, k]: key after query
            mask = causal.unsqueeze(0) | (ar.unsqueeze(0) < pads.unsqueeze(1)).unsqueeze(1)  # [B, q, k]
            mask = mask.unsqueeze(1)
        logits = self._forward(tokens[:, :t], 0, ctx, mask)
        ctx.sequence_len_offset = t
        active = torch.arange(B, device=device)  # original row of each batch row
        steps = 1
        while True:
            gen = ends[active] <= t  # rows past their prompt: sample position t
            if bool(gen.any()):
                rows = active[gen]
                tok, lp = sample_tokens(logits[gen], params, generator)
                tokens[rows, t] = tok
                logprobs[rows, t] = lp
                n_gen[rows] += 1
                stopped = torch.isin(tok, stop_ids)
                done = stopped | (n_gen[rows] >= params.max_new_tokens) | (t + 1 >= total)
                for r, st in zip(rows[done].tolist(), stopped[done].tolist()):
                    finish[r] = "stop" if st else "length"
                keep = torch.ones(active.shape[0], dtype=torch.bool, device=device)
                keep[gen.nonzero().squeeze(-1)[done]] = False
                if not bool(keep.all()):
                    keep_idx = keep.nonzero().squeeze(-1)
                    active = active[keep_idx]
                    if active.numel() == 0:
                        break
                    n = active.shape[0]
                    for k, v in ctx.key_value_memory_dict.values():
                        k[:t, :n] = k[:t, keep_idx].clone()
                        v[:t, :n] = v[:t, keep_idx].clone()
            if t + 1 >= total:
                break
            mask = None
            if use_mask:
                mask = (torch.arange(t + 1, device=device).unsqueeze(0) < pads[active].unsqueeze(1))
                mask = mask.view(active.shape[0], 1, 1, t + 1)
            logits = self._forward(tokens[active, t:t + 1], t, ctx, mask)
            ctx.sequence_len_offset = t + 1
            t += 1
            steps += 1

        out = []
        for i, p in enumerate(prompts):
            e, g = int(ends[i]), int(n_gen[i])
            out.append(RolloutSample(token_ids=tokens[i, e:e + g].tolist(), logprobs=logprobs[i, e:e + g].tolist(),
                                     finish_reason=finish[i], prompt_length=len(p)))
        return out, steps
