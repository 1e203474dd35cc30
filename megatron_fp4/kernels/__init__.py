"""Triton and CUDA C++ kernels for FP4 (HiF4 / MXFP4) on Hopper, each with its PyTorch twin (``megatron_fp4.formats``).

Modules (import them directly; importing the package loads nothing heavy):

- ``megatron_fp4.kernels.quantize``: fused quantize+pack along any dim (row or column variant), optional GEMM-ready
  expansion (written into given buffers with ``out=``: CUDA graphs' persistent weights); a transposed view's exact
  expansion by the column kernel, from the row-major tensor.
- ``megatron_fp4.kernels.gemm``: the pre-expanded GEMMs (one tensor-core GEMM on the operands' BF16 / MXFP4 FP8
  expansions, cuBLAS where it applies), what the training linears and prefill run.
- ``megatron_fp4.kernels.packed_gemm``: the packed-prologue GEMM (both operands read packed, dequantized in the main
  loop).
- ``megatron_fp4.kernels.decode_gemm``: the Triton decode GEMM (M <= 64: packed weights dequantized in registers x BF16
  activations or the activations' exact expansions; ResQ on the same weight read).
- ``megatron_fp4.kernels.resq``: the fused Rollout-ResQ quantizer (Q(X), 2:4-sparse Q(X - Q(X))) and its GEMM.
- ``megatron_fp4.kernels.cuda_decode``: the CUDA C++ decode GEMMs (``csrc/w4_wgmma.cu`` on the warpgroup MMA,
  ``csrc/w4_decode.cu`` on mma.sync; their shared device code ``csrc/w4_device.h``; built with nvcc on first use) and
  the weight layout they read, with a PyTorch emulation of its dequantization for CPU tests.
- ``megatron_fp4.kernels.cuda_quantize``: the CUDA C++ both-layouts quantizer (``csrc/quant_both.cu``): a training
  operand's two exact BF16 expansions (along K and along the tokens) from one read; its unit math
  (``csrc/quant_math.h``) is also built for the host in the CPU tests. ``megatron_fp4.kernels._nvcc`` builds and loads
  the CUDA sources.
- ``megatron_fp4.kernels.decode_ops``: fused kernels of the native engine's decode step (residual add + RMSNorm,
  RoPE + KV-cache write, SwiGLU, attention over each sequence's cache up to its position, a GEMM's split sums + bias
  rounded once), each beside its PyTorch twin.
- ``megatron_fp4.kernels.logprobs``: fused next-token log-probs, entropy and their gradient over a (vocab-parallel)
  logits row, one read of the logits per pass (the RL loss head on CUDA; ``megatron_fp4.rl.logprobs`` calls it).
- ``megatron_fp4.kernels._launch``: ``fast(kernel)[grid](...)``, a launch that skips Triton's Python launch path after a
  specialization's first launch (the training quantize kernels; opt-in, ``MEGATRON_FP4_FAST_LAUNCH=1``).
- ``megatron_fp4.kernels.dispatch``: what the rest of the project calls (``fp4_gemm``, ``prepare_weight``, ``linear``,
  ``decode_matmul``); falls back to the PyTorch reference without Triton or a GPU. The training GEMMs reach the
  kernels through ``megatron_fp4.ops.kernels_backend``; nothing here imports ``megatron_fp4.ops`` (only
  ``megatron_fp4.gemm_backend``: the backend interface and the reference GEMM).

Numbers and targets: docs/PERFORMANCE.md. Tests: tests/test_kernels.py (CPU interpreter + ``gpu`` marker).
"""
