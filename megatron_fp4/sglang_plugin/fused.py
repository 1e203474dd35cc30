"""Fused ResQ operands inside SGLang's models: the norm before qkv_proj / gate_up_proj and the SwiGLU before
down_proj make the next FP4 linear's W4A4 + ResQ 2:4 (bf16 sum) operand in one CUDA kernel each, as the native
engine's decode step does (``megatron_fp4/rollout/static_decode.py``; the kernels are
``cuda_quantize.swiglu_resq`` and ``norm_resq``, the two unfused kernels' bits).

SGLang (0.5.17 and 0.5.23) has no hook for a quantization method to take over the op before its linear, so the
plug-in makes one from torch's module-registration hook, installed when a :class:`MegatronFP4Config` at that
precision is made (before SGLang builds the model): as a layer assigns its ``act_fn`` (a ``SiluAndMul``) or its
``input_layernorm`` / ``post_attention_layernorm`` (an ``RMSNorm``), and the linear that reads it (the layer's
``down_proj``, ``self_attn.qkv_proj``, ``mlp.gate_up_proj``) is one of ours at that precision, the module's class
becomes :class:`SiluAndMulResQ` / :class:`RMSNormResQ`: the same object, parameters and names (weights load as
before), whose forward makes the operand where the kernel applies and hands it to the linear (:func:`hand`). The
linear's ``apply`` takes it (:func:`take`) and multiplies it as W4A16: the GEMM that W4A4 + ResQ 2:4 (bf16 sum)
runs after its own quantize. Elsewhere (CPU, shapes the kernels do not take) SGLang's own forward runs and the
linear quantizes as before. ``MEGATRON_FP4_FUSED_SWIGLU_RESQ=0`` / ``MEGATRON_FP4_FUSED_NORM_RESQ=0`` (the native
engine's switches, read when the model is built) keep SGLang's modules.

The fused norm computes :func:`megatron_fp4.kernels.decode_ops.add_rms_norm`'s arithmetic (torch's RMSNorm: the
sum rounded to bf16, then normed in fp32), which can differ from SGLang's fused add + RMSNorm kernel in the last
bf16 bit of a normed value; the SwiGLU is the native engine's too.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
from sglang.srt.layers.activation import SiluAndMul
from sglang.srt.layers.layernorm import RMSNorm

from megatron_fp4.kernels import cuda_quantize
from megatron_fp4.kernels._common import switch_on
from megatron_fp4.kernels.cuda_quantize import NORM_RESQ_SWITCH, SWIGLU_RESQ_SWITCH

__all__ = ["install", "hand", "take", "SiluAndMulResQ", "RMSNormResQ"]
#: Where each norm's output goes in SGLang's decoder layers (Qwen2, Llama): the attribute path of its linear.
NORM_READERS = {"input_layernorm": ("self_attn", "qkv_proj"), "post_attention_layernorm": ("mlp", "gate_up_proj")}
_OPERAND = "_megatron_fp4_operand"  # on a linear: a weak reference to the operand made for its next call
_READER = "_megatron_fp4_reader"  # on a producer: a weak reference to the linear that reads its output
_hook = None


def operand_format(linear: Optional[torch.nn.Module]) -> Optional[str]:
    """The FP4 format of ``linear`` when the plug-in serves it at W4A4 + ResQ 2:4 (bf16 sum), else None."""
    return getattr(getattr(linear, "quant_method", None), "fused_operand_format", None)


def hand(linear: torch.nn.Module, operand: torch.Tensor) -> torch.Tensor:
    """Mark ``operand`` as the ResQ bf16-sum operand of ``linear``'s next call (a weak reference: an operand that
    never reaches the linear leaves nothing behind); returns it."""
    linear.__dict__[_OPERAND] = weakref.ref(operand)
    return operand


def take(linear: torch.nn.Module, x: torch.Tensor) -> bool:
    """Whether ``x`` is the operand a fused op made for this call of ``linear`` (then forgotten)."""
    ref = linear.__dict__.pop(_OPERAND, None)
    made = ref() if ref is not None else None
    if made is None:
        return False
    if x is made or (x.data_ptr() == made.data_ptr() and x.shape == made.shape and x.stride() == made.stride()):
        return True
    raise RuntimeError(f"megatron_fp4: {type(linear).__name__} got another tensor than the ResQ operand its fused "
                       f"norm / SwiGLU made for it ({tuple(x.shape)} vs {tuple(made.shape)}): this model transforms "
                       f"the op's output before the linear; set {NORM_RESQ_SWITCH}=0 and {SWIGLU_RESQ_SWITCH}=0")


def _reader(module: torch.nn.Module) -> Optional[tuple[torch.nn.Module, str]]:
    """(the linear that reads ``module``'s output, its format) while it is ours at the fused precision, and SGLang
    has not put the module in its torch.compile mode (its native forward then)."""
    if getattr(module, "is_torch_compile", False):
        return None
    linear = module.__dict__[_READER]()
    fmt = operand_format(linear)
    return None if fmt is None else (linear, fmt)


class SiluAndMulResQ(SiluAndMul):
    """SGLang's ``SiluAndMul`` before an FP4 ``down_proj`` at W4A4 + ResQ 2:4 (bf16 sum): returns down_proj's
    operand, ``cuda_quantize.swiglu_resq`` of ``[gate | up]``, where that kernel takes it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        got = _reader(self)
        if got is not None:
            if cuda_quantize.swiglu_resq_usable(x, got[1]):
                return hand(got[0], cuda_quantize.swiglu_resq(x, got[1]))
        return super().forward(x)


class RMSNormResQ(RMSNorm):
    """SGLang's ``RMSNorm`` before an FP4 qkv_proj / gate_up_proj at W4A4 + ResQ 2:4 (bf16 sum): returns the
    linear's operand of the normed ``x + residual`` (and that sum as the new residual), from
    ``decode_ops.rms_norm_resq``, where that kernel takes them and no other argument asks for something else."""

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None, *args, **kwargs):
        got = _reader(self)
        plain = (not any(a is not None for a in args)
                 and all(v is None for k, v in kwargs.items() if k != "quant_linear")  # (0.5.23: an FP8 hint)
                 and getattr(self, "variance_size_override", None) is None
                 and not getattr(self, "cast_x_before_out_mul", False) and not getattr(self, "fp32_residual", False))
        if got is not None and plain:
            from megatron_fp4.kernels import decode_ops

            fused = decode_ops.rms_norm_resq(x, residual, self.weight, self.variance_epsilon, got[1])
            if fused is not None:
                operand = hand(got[0], fused[0])
                return operand if residual is None else (operand, fused[1])
        return super().forward(x, residual, *args, **kwargs)


def _attribute_path(module: torch.nn.Module, path: tuple) -> Optional[torch.nn.Module]:
    for name in path:
        module = getattr(module, name, None)
    return module


def _on_register(parent: torch.nn.Module, name: str, module: Optional[torch.nn.Module]) -> None:
    """torch's module-registration hook: a SiluAndMul / RMSNorm whose reader is ours at the fused precision
    becomes the fused class (in place)."""
    if type(module) is SiluAndMul and name == "act_fn" and switch_on(SWIGLU_RESQ_SWITCH):
        reader, cls = getattr(parent, "down_proj", None), SiluAndMulResQ
    elif type(module) is RMSNorm and name in NORM_READERS and switch_on(NORM_RESQ_SWITCH):
        reader, cls = _attribute_path(parent, NORM_READERS[name]), RMSNormResQ
    else:
        return None
    if operand_format(reader) is not None:
        module.__class__ = cls
        module.__dict__[_READER] = weakref.ref(reader)
    return None


def install() -> None:
    """Install the registration hook in this process (once)."""
    global _hook
    if _hook is None:
        _hook = torch.nn.modules.module.register_module_module_registration_hook(_on_register)
