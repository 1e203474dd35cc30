"""FP4 linear layer: Y = X W^T (+ b) with quantized fprop, dgrad and wgrad GEMMs (SPEC §3).

Each GEMM quantizes its two operands along ITS reduction dimension and accumulates in fp32:

- fprop:  Y[m,n]  = Q_K(X) . Q_K(W)^T        (activation format x weight format)
- dgrad:  dX[m,K] = Q_n(dY) . Q_n(W^T)^T     (gradient format x weight format)
- wgrad:  dW[n,K] = Q_m(dY^T) . Q_m(X^T)^T   (gradient format x activation format), optionally after the same
  random-sign block Hadamard transform along m on both operands (exact product unchanged).

X may be ``[..., K]``; leading dims are flattened to the token dimension m. The GEMMs go through
``megatron_fp4.ops.fp4_gemm``, which rounds each result once to the operand dtype and, inside
``ops.quantized_weight_cache``, quantizes each weight (W for fprop, W^T for dgrad) once per weight version. Which recipe applies: an active ``fp4_autocast`` (including
``enabled=False``) wins; otherwise the recipe given to the function/module; with none, the layer is a plain
``torch.nn.functional.linear`` (bit-identical to high precision).
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F

from megatron_fp4 import ops
from megatron_fp4.formats import InvalidTensorError, check_tensor
from megatron_fp4.recipe import FP4Recipe, fp4_autocast_active, get_fp4_recipe

__all__ = [
    "fp4_linear",
    "FP4Linear",
    "FP4LinearFunction",
    "current_recipe",
    "hadamard_matrix",
    "random_hadamard_transform",
]


def current_recipe(default: Optional[FP4Recipe] = None) -> Optional[FP4Recipe]:
    """The recipe a linear should use now: the innermost ``fp4_autocast`` if one is active, else ``default``."""
    if fp4_autocast_active():  # an fp4_autocast block is open (its recipe may be None = FP4 off)
        return get_fp4_recipe()
    return default


# --------------------------------------------------------------------------------------------------------------------
# Random Hadamard transform for the wgrad operands
# --------------------------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _hadamard_cpu(block_size: int, seed: int) -> torch.Tensor:
    if block_size <= 0 or block_size & (block_size - 1):
        raise ValueError(f"hadamard block_size={block_size} must be a power of two")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block_size:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    h = h / math.sqrt(block_size)
    gen = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (block_size,), generator=gen).to(torch.float64) * 2 - 1
    return (signs[:, None] * h).to(torch.float32)  # diag(signs) @ H, orthogonal


def hadamard_matrix(block_size: int, seed: int, device=None) -> torch.Tensor:
    """The orthogonal fp32 matrix ``diag(s) H / sqrt(b)`` (Sylvester H, random signs s from ``seed``)."""
    return _hadamard_cpu(block_size, seed).to(device=device)


def random_hadamard_transform(x: torch.Tensor, block_size: int, seed: int) -> torch.Tensor:
    """Apply the block-diagonal random Hadamard transform along the last dim of 2-D ``x`` (fp32 result).

    The last dim is zero-padded to a multiple of ``block_size`` (the result keeps the padded length). Applying
    it to both operands of ``A @ B^T`` (same length, same seed) leaves the product unchanged.
    """
    rows, length = x.shape
    pad = (-length) % block_size
    xf = x.float()
    if pad:
        xf = F.pad(xf, (0, pad))
    h = hadamard_matrix(block_size, seed, device=x.device)
    return (xf.reshape(rows, -1, block_size) @ h).reshape(rows, -1)


# --------------------------------------------------------------------------------------------------------------------
# Autograd function
# --------------------------------------------------------------------------------------------------------------------
def _flatten(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def _one_pass_operands(recipe: FP4Recipe) -> bool:
    """Whether X and dY can each be quantized once into both of their GEMM layouts (``ops.quantize_both``): all
    three GEMMs quantized, one format, nearest rounding, no Hadamard transform (which changes the wgrad operands)."""
    return (recipe.quantize_fprop and recipe.quantize_dgrad and recipe.quantize_wgrad and not recipe.hadamard_wgrad
            and recipe.gradient_rounding == "nearest"
            and recipe.weight_format == recipe.activation_format == recipe.gradient_format)


class FP4LinearFunction(torch.autograd.Function):
    """Y = X W^T + b with the three GEMMs quantized as the recipe says. ``recipe`` must not be None.

    Where the recipe allows (:func:`_one_pass_operands`) and W needs a gradient, the forward quantizes X once along
    K (fprop) and along m (wgrad) and keeps the latter instead of X; the backward does the same with dY. The
    numbers are those of quantizing each GEMM's operands separately."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], recipe: FP4Recipe,
                wgrad_follows: bool = False):
        """``wgrad_follows``: a backward computing W's gradient will run (the caller's grad mode; autograd turns
        it off inside forward)."""
        x2 = _flatten(x)
        ctx.recipe, ctx.has_bias, ctx.x_meta, ctx.xt = recipe, bias is not None, (x.shape, x.dtype), None
        pair = None
        if wgrad_follows and _one_pass_operands(recipe):
            pair = ops.quantize_both(x2, recipe.format("activation"), recipe.gemm_mode, b_cols=True)
        if pair is not None:
            y = ops.fp4_gemm(pair[0], weight, None, recipe.format("weight"), out_dtype=x.dtype,
                             mode=recipe.gemm_mode, cache_b=True)
            ctx.xt = pair[1]  # Q_m(X^T): all the backward needs of X
            ctx.save_for_backward(weight)
        else:
            if recipe.quantize_fprop:
                y = ops.fp4_gemm(x2, weight, recipe.format("activation"), recipe.format("weight"),
                                 out_dtype=x.dtype, mode=recipe.gemm_mode, cache_b=True)
            else:
                y = torch.matmul(x2, weight.t())
            ctx.save_for_backward(weight, x)
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        weight, *saved_x = ctx.saved_tensors
        recipe: FP4Recipe = ctx.recipe
        x_shape, x_dtype = ctx.x_meta
        dy2 = _flatten(dy)
        grad_x = grad_w = grad_b = None
        g_fmt, g_round, w_fmt = recipe.format("gradient"), recipe.rounding("gradient"), recipe.format("weight")
        if ctx.xt is not None:  # one-pass operands: dY quantized once for dgrad and wgrad
            pair = ops.quantize_both(dy2, g_fmt, recipe.gemm_mode)
            dy_rows, dy_cols = pair if pair is not None else (dy2, dy2.t())
            if ctx.needs_input_grad[0]:
                grad_x = ops.fp4_gemm(dy_rows, weight.t(), g_fmt, w_fmt, out_dtype=x_dtype, mode=recipe.gemm_mode,
                                      cache_b=True).reshape(x_shape)
            grad_w = ops.fp4_gemm(dy_cols, ctx.xt, g_fmt, None, out_dtype=weight.dtype, mode=recipe.gemm_mode)
        else:
            x = saved_x[0]
            if ctx.needs_input_grad[0]:
                if recipe.quantize_dgrad:
                    # dX[m,K] = Q_n(dY)[m,n] . Q_n(W^T)[K,n]^T
                    grad_x = ops.fp4_gemm(dy2, weight.t(), g_fmt, w_fmt, a_rounding=g_round, out_dtype=x_dtype,
                                          mode=recipe.gemm_mode, cache_b=True)
                else:
                    grad_x = torch.matmul(dy2, weight)
                grad_x = grad_x.reshape(x_shape)
            if ctx.needs_input_grad[1]:
                x2 = _flatten(x)
                if recipe.quantize_wgrad:
                    # dW[n,K] = Q_m(dY^T)[n,m] . Q_m(X^T)[K,m]^T
                    a, b = dy2.t(), x2.t()
                    if recipe.hadamard_wgrad:
                        a = random_hadamard_transform(a, recipe.hadamard_block_size, recipe.hadamard_seed)
                        b = random_hadamard_transform(b, recipe.hadamard_block_size, recipe.hadamard_seed)
                    grad_w = ops.fp4_gemm(a, b, g_fmt, recipe.format("activation"), a_rounding=g_round,
                                          out_dtype=weight.dtype, mode=recipe.gemm_mode)
                else:
                    grad_w = torch.matmul(dy2.t(), x2)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = dy2.sum(dim=0)
        return grad_x, grad_w, grad_b, None, None


def fp4_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    recipe: Optional[FP4Recipe] = None,
) -> torch.Tensor:
    """Differentiable FP4 ``x @ weight^T + bias`` under ``recipe`` (None: the active fp4_autocast recipe);
    plain ``F.linear`` when there is no recipe."""
    if recipe is None:
        recipe = get_fp4_recipe()
    if recipe is None:
        return F.linear(x, weight, bias)
    if not isinstance(recipe, FP4Recipe):
        raise TypeError(f"fp4_linear: recipe must be an FP4Recipe or None, got {type(recipe).__name__}")
    check_tensor(x, "x", "fp4_linear")
    check_tensor(weight, "weight", "fp4_linear", ndim=2)
    if x.shape[-1] != weight.shape[1]:
        raise InvalidTensorError(f"fp4_linear: x has {x.shape[-1]} features but weight is {tuple(weight.shape)}")
    if bias is not None:
        check_tensor(bias, "bias", "fp4_linear", ndim=1)
        if bias.shape[0] != weight.shape[0]:
            raise InvalidTensorError(f"fp4_linear: bias has {bias.shape[0]} values but weight is "
                                     f"{tuple(weight.shape)}")
    return FP4LinearFunction.apply(x, weight, bias, recipe, torch.is_grad_enabled() and weight.requires_grad)


class FP4Linear(torch.nn.Linear):
    """``torch.nn.Linear`` whose GEMMs run in FP4 under a recipe (its own ``recipe`` or an active fp4_autocast).

    Same parameters, names and initialization as ``torch.nn.Linear``; with no recipe it is bit-identical to it.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 recipe: Optional[FP4Recipe] = None, device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        if recipe is not None and not isinstance(recipe, FP4Recipe):
            raise TypeError(f"recipe must be an FP4Recipe or None, got {type(recipe).__name__}")
        self.recipe = recipe

    def fp4_recipe_for_forward(self) -> Optional[FP4Recipe]:
        """The recipe the next forward will use (None: high precision)."""
        return current_recipe(self.recipe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp4_linear(x, self.weight, self.bias, self.fp4_recipe_for_forward())

    def extra_repr(self) -> str:
        return super().extra_repr() + f", recipe={self.recipe!r}"
