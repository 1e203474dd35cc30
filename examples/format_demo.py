"""Format demo: MSE and underflow rate of each FP4 format on an activation tensor with outliers.

    python examples/format_demo.py [--tokens 256 --hidden 4096 --outlier-channels 8 --outlier-scale 50]
"""

import argparse

import torch

from megatron_fp4.formats import get_format, underflow_rate


def outlier_activations(tokens: int, hidden: int, channels: int, scale: float, seed: int = 0) -> torch.Tensor:
    """Gaussian activations with a few large-magnitude channels, like LLM down_proj inputs."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    idx = torch.randperm(hidden, generator=gen)[:channels]
    x[:, idx] *= scale
    return x.to(torch.bfloat16)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--outlier-channels", type=int, default=8)
    p.add_argument("--outlier-scale", type=float, default=50.0)
    args = p.parse_args()
    x = outlier_activations(args.tokens, args.hidden, args.outlier_channels, args.outlier_scale)
    xf = x.float()
    print(f"activations {tuple(x.shape)} bf16, {args.outlier_channels} outlier channels x{args.outlier_scale}")
    print(f"{'format':<12}{'bits/value':>11}{'MSE':>12}{'rel. MSE':>11}{'underflow':>11}")
    for name in ("hif4", "mxfp4", "nvfp4"):
        fmt = get_format(name)
        err = fmt.fake_quantize(x).float() - xf
        mse = float(err.pow(2).mean())
        print(f"{name:<12}{fmt.bits_per_value:>11}{mse:>12.4e}{mse / float(xf.pow(2).mean()):>11.4f}"
              f"{underflow_rate(x, fmt):>10.2%}")


if __name__ == "__main__":
    main()
