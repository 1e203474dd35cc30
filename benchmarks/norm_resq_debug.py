"""WIP (branch wip/fused-resq-operands): where the fused norm + ResQ kernel's normed values differ from the Triton
``add_rms_norm`` (session 47, docs/PERFORMANCE.md: one bf16 unit, in a few values of a few rows; never in ResQ). The
likely cause, found in the SASS after the GPU call, is fixed in norm_resq.cu (mean_eps: mean + eps rounded once, as
the Triton norm's FFMA); ``dump`` on a GPU then shows 0 rows differing, and ``emulate`` says whether the sums of
squares agree (a second cause would show there).

On a GPU with nvcc, ``dump`` compares the two kernels on random rows (no delta), and for the first shapes that
differ saves the inputs, both kernels' normed values and the Triton kernel's per-row sum of squares and r (a debug
kernel built on the norm's own ``_residual_row``):

    PYTHONPATH=. python3 benchmarks/norm_resq_debug.py dump --out norm_dump.pt

On any machine, ``emulate`` replays the fused kernel's order (per-thread strips of 8, the fp32 chain, the lanes' and
the warps' butterflies; the squares of bf16 values are exact in fp32) on the saved rows and says, per shape, in how
many rows its sum of squares equals the Triton kernel's, and whether y = bf16((s * r) * w) with the Triton kernel's r
gives the Triton kernel's values (then a differing r explains the difference):

    python3 benchmarks/norm_resq_debug.py emulate norm_dump.pt
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

SHAPES = ((64, 8960), (64, 3584), (64, 1536))


from megatron_fp4.kernels._common import HAS_TRITON, tl, triton  # noqa: E402

if HAS_TRITON:
    from megatron_fp4.kernels.decode_ops import _residual_row

    @triton.jit
    def _tot_kernel(x_ptr, t_ptr, r_ptr, N, eps, stride_x, BLOCK: tl.constexpr):
        """The Triton norm's per-row sum of squares and r, through its own _residual_row (no delta)."""
        xf, r, cols, m = _residual_row(x_ptr, x_ptr, x_ptr, N, eps, stride_x, 0, 0, 0, 1, False, BLOCK)
        tl.store(t_ptr + tl.program_id(0), tl.sum(xf * xf, axis=0))
        tl.store(r_ptr + tl.program_id(0), r)


def dump(out: str, trials: int) -> None:
    from megatron_fp4.kernels import cuda_quantize as cq
    from megatron_fp4.kernels.decode_ops import _norm_warps, add_rms_norm

    torch.manual_seed(0)
    saved = {}
    for B, N in SHAPES:
        norm = torch.nn.RMSNorm(N, eps=1e-6, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.1 * torch.randn(N, device="cuda"))
        block = 1 << (N - 1).bit_length()
        warps = _norm_warps(block)
        for trial in range(trials):
            x = (torch.randn(B, N, device="cuda") * 3).bfloat16()
            h, _ = add_rms_norm(x, None, norm)
            normed = torch.empty_like(h)
            cq.norm_resq(x, None, norm.weight, norm.eps, "hif4", warps, normed)
            tot, r = torch.empty(B, device="cuda"), torch.empty(B, device="cuda")
            _tot_kernel[(B,)](x, tot, r, N, norm.eps, x.stride(0), BLOCK=block, num_warps=warps)
            rows = (normed.view(torch.int16) != h.view(torch.int16)).any(1)
            print(f"{B} x {N} trial {trial}: {rows.sum().item()} rows differ", flush=True)
            if rows.any() and str(N) not in saved:
                saved[str(N)] = dict(x=x.cpu(), w=norm.weight.detach().cpu(), h=h.cpu(), normed=normed.cpu(),
                                     tot=tot.cpu(), r=r.cpu(), rows=rows.cpu(), warps=warps, block=block)
    torch.save(saved, out)
    print(f"saved {sorted(saved)} to {out}")


def _bf16(a: np.ndarray) -> np.ndarray:
    """fp32 rounded to bf16 (to nearest even), as fp32."""
    b = a.astype(np.float32).view(np.uint32).astype(np.uint64)
    return (((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)).view(np.float32)


def fused_order_sum(x: np.ndarray, warps: int, block: int) -> np.ndarray:
    """Each row's sum of squares in the fused kernel's order (norm_resq.cu), fp32."""
    B, N = x.shape
    threads = 32 * warps
    reps = block // (8 * threads)
    xp = np.zeros((B, block), np.float32)
    xp[:, :N] = x
    v = xp.reshape(B, reps, threads, 8).transpose(0, 2, 1, 3).reshape(B, threads, reps * 8)
    sq = v * v  # (exact: bf16 values)
    acc = sq[:, :, 0] + sq[:, :, 1]
    for i in range(2, reps * 8):
        acc = acc + sq[:, :, i]
    acc = acc.reshape(B, warps, 32)
    for off in (16, 8, 4, 2, 1):
        acc = acc + acc[:, :, np.arange(32) ^ off]
    tot = acc[:, :, 0]
    off = warps // 2
    while off >= 1:
        tot = tot + tot[:, np.arange(warps) ^ off]
        off //= 2
    return tot[:, 0]


def emulate(path: str) -> None:
    for N, e in torch.load(path).items():
        x = e["x"].float().numpy()
        rows = e["rows"].numpy()
        same = fused_order_sum(x, e["warps"], e["block"]) == e["tot"].numpy()
        r = e["r"].numpy().astype(np.float32)
        y = _bf16((x * r[:, None]) * e["w"].float().numpy()[None, :])
        print(f"N {N}: the fused order's sum of squares equals the Triton kernel's in {same.sum()} of {len(same)} "
              f"rows (the differing rows {np.nonzero(rows)[0].tolist()}: {same[rows].tolist()}); y from the Triton "
              f"kernel's r equals its output: {bool((y == e['h'].float().numpy()).all())}, the fused kernel's: "
              f"{bool((y == e['normed'].float().numpy()).all())}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump", help="on a GPU: compare, and save the rows of the first differing shapes")
    d.add_argument("--out", default="norm_dump.pt")
    d.add_argument("--trials", type=int, default=6)
    m = sub.add_parser("emulate", help="on any machine: the fused kernel's order against the dump")
    m.add_argument("path")
    a = ap.parse_args(argv)
    dump(a.out, a.trials) if a.cmd == "dump" else emulate(a.path)


if __name__ == "__main__":
    main()
