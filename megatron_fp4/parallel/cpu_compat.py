"""CPU compatibility shims for megatron-core, and a helper that initializes torch.distributed + parallel_state.

megatron-core 0.16 assumes CUDA in a few places (``torch.cuda.current_device()`` as a device, tensors created
with ``device="cuda"`` in the pipeline schedules, the optimizer and grad clipping, ``torch.cuda.synchronize()``).
This module is the ONE place that works around that: :func:`apply_cpu_shims` is a no-op when CUDA is available;
without CUDA it

- makes ``torch.cuda.current_device()`` return ``"cpu"`` and ``torch.cuda.synchronize()`` a no-op;
- pushes a ``TorchFunctionMode`` that rewrites ``device="cuda"`` / ``device=torch.device("cuda", i)``
  arguments of torch factory functions and ``Tensor.to`` / ``Tensor.cuda`` to the CPU, and makes
  ``Tensor.type()`` name CPU tensors as CUDA ones ("torch.cuda.BFloat16Tensor"), which megatron's mixed-precision
  optimizer checks;
- replaces megatron's ``clip_grad_by_total_norm_fp32`` (it asserts ``torch.cuda.FloatTensor`` grads) by the
  same scaling done on CPU tensors, so ``OptimizerConfig(clip_grad=...)`` works.

Settings megatron-core needs on CPU are returned by :func:`cpu_config_overrides` (no fusions that need CUDA
kernels, CPU initialization, no p2p synchronization). The RNG tracker is set with
``model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)``: its ``fork()`` is a no-op, so it never
touches the CUDA RNG, and dropout inside tensor-parallel regions draws from the default CPU generator.
Use :func:`initialize_parallel` to set everything up, single process or under ``torchrun``.
"""

from __future__ import annotations

import datetime
import os
from typing import Any, Optional

import torch
from torch.overrides import TorchFunctionMode

__all__ = [
    "apply_cpu_shims",
    "cpu_shims_active",
    "cpu_config_overrides",
    "initialize_parallel",
    "destroy_parallel",
    "set_seed",
]

_SHIMS_APPLIED = False
_MODE: Optional[TorchFunctionMode] = None


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device == "cuda" or device.startswith("cuda:")
    return False


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to the CPU (factory functions, ``Tensor.to``, ``Tensor.cuda``)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = dict(kwargs, device="cpu")
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # megatron's optimizers check parameter types by name ("torch.cuda.BFloat16Tensor", ...)
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if args[0].device.type == "cpu" else name
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu") + tuple(args[2:])
        return func(*args, **kwargs)


def _no_op(*args, **kwargs) -> None:
    return None


def _clip_grad_by_total_norm_fp32_cpu(parameters, max_norm, total_norm, use_decoupled_grad: bool = False):
    """CPU twin of megatron's clip_grad_by_total_norm_fp32: scale every fp32 grad by max_norm / total_norm."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff >= 1.0:
        return
    for param in parameters:
        grad = getattr(param, "decoupled_grad", None) if use_decoupled_grad else param.grad
        if grad is not None:
            grad.detach().mul_(clip_coeff)


def apply_cpu_shims() -> bool:
    """Install the CPU shims if CUDA is absent (idempotent). Returns True when the shims are active."""
    global _SHIMS_APPLIED, _MODE
    if torch.cuda.is_available():
        return False
    if _SHIMS_APPLIED:
        return True
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.synchronize = _no_op  # type: ignore[assignment]
    # megatron's default causal mask is lru-cached and built on "cuda"; the mode below redirects it.
    _MODE = _CudaToCpuMode()
    _MODE.__enter__()
    from megatron.core.optimizer import clip_grads as _clip_grads
    from megatron.core.optimizer import optimizer as _optimizer

    _clip_grads.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32_cpu
    _optimizer.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32_cpu
    _SHIMS_APPLIED = True
    return True


def cpu_shims_active() -> bool:
    """Whether :func:`apply_cpu_shims` installed the shims in this process."""
    return _SHIMS_APPLIED


def cpu_config_overrides() -> dict:
    """TransformerConfig / ModelParallelConfig fields that megatron-core needs on CPU (empty dict with CUDA)."""
    if torch.cuda.is_available():
        return {}
    return dict(
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        batch_p2p_sync=False,
        batch_p2p_comm=True,
    )


def collective_device() -> torch.device:
    """Where tensors for collectives live: the current GPU under NCCL, else the CPU (gloo)."""
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def initialize_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    seed: int = 1234,
    backend: Optional[str] = None,
    timeout_s: float = 300.0,
    cuda_graphs: bool = False,
) -> None:
    """Initialize torch.distributed (gloo on CPU, nccl on GPU) and megatron ``parallel_state``, then seed RNGs.

    Works single-process (no ``torchrun`` environment: world size 1, in-memory store) and under
    ``torchrun`` (reads RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT). Data-parallel size is what is left:
    world_size / (TP * PP). Idempotent for the same sizes. ``cuda_graphs``: see :func:`set_seed`.
    """
    from megatron.core import parallel_state

    cuda = torch.cuda.is_available()
    if not cuda:
        apply_cpu_shims()
    if not torch.distributed.is_initialized():
        store = None
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            # One process on its own: an in-memory store, no TCP port (several single-process runs started at
            # once used to race for the same "free" port: EADDRINUSE). os.environ stays as it is: RANK set here
            # would leak into subprocesses this process starts (they would wait for a torchrun rendezvous).
            store = torch.distributed.HashStore()
            rank, world = 0, 1
        else:
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.distributed.init_process_group(
            backend=backend or ("nccl" if cuda else "gloo"),
            store=store,
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    world = torch.distributed.get_world_size()
    if world % (tensor_model_parallel_size * pipeline_model_parallel_size) != 0:
        raise ValueError(
            f"world size {world} is not divisible by tensor_model_parallel_size={tensor_model_parallel_size} "
            f"x pipeline_model_parallel_size={pipeline_model_parallel_size}"
        )
    if parallel_state.model_parallel_is_initialized():
        if (parallel_state.get_tensor_model_parallel_world_size() == tensor_model_parallel_size
                and parallel_state.get_pipeline_model_parallel_world_size() == pipeline_model_parallel_size):
            set_seed(seed, cuda_graphs)
            return
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
    )
    set_seed(seed, cuda_graphs)


def set_seed(seed: int, cuda_graphs: bool = False) -> None:
    """Seed torch (CPU and CUDA) and megatron's model-parallel RNG tracker (CPU-safe tracker without CUDA).
    ``cuda_graphs``: a tracker whose generators CUDA graphs can capture (what megatron's ``cuda_graph_impl="local"``
    layers require)."""
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=cuda_graphs, force_reset_rng=True)
    else:
        tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)


def destroy_parallel() -> None:
    """Tear down megatron parallel_state and the torch.distributed process group."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
