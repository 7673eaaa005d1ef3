#!/usr/bin/env python3
"""Is a cuBLAS(Lt) BF16 GEMM batch-invariant on this GPU? (a diagnostic for the RL mismatch)

The RL sampler's passes hold a few rows (one token per sequence) and the trainer's forward all of
them; if the GEMM's result for a row depended on how many rows share the call (a different
algorithm, tile or split-K for another M), the two would see different activations even with
bit-identical quantization. This script multiplies the first M rows of X [8192, K] alone and as
part of all 8192 rows, through torch.matmul (cuBLASLt underneath, as fourbit's GEMMs), and prints
for each shape the fraction of output elements that are bitwise equal and the largest difference in
BF16 ulps. No assertion: it measures, for bench notes.

  python3 tools/batch_invariance_check.py [--device cuda]
"""
import argparse

import torch


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units of the BF16 spacing of a (elementwise, as float)."""
    ai = a.view(torch.int16).to(torch.int32)
    bi = b.view(torch.int16).to(torch.int32)
    # Same-sign values: the integer distance of the bit patterns is the ulp distance.
    return (ai - bi).abs().to(torch.float32)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--big", type=int, default=8192, help="rows of the trainer-like call")
    a = p.parse_args()
    torch.manual_seed(0)
    shapes = [(768, 2304), (768, 768), (768, 6144), (3072, 768), (2048, 2560), (2048, 11264), (5632, 2048)]
    print(f"{torch.cuda.get_device_name() if a.device == 'cuda' else 'cpu'}, torch {torch.__version__}")
    print(f"{'K':>6} {'N':>6} {'M':>5}  {'bf16 equal':>10} {'max ulp':>8}  {'f32 equal':>9} {'max rel':>9}")
    for k, n in shapes:
        x = torch.randn(a.big, k, device=a.device, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=a.device, dtype=torch.bfloat16) / k ** 0.5
        full = x @ w.t()
        full32 = torch.matmul(x.float(), w.float().t())
        for m in (1, 8, 64, 256, 1024):
            part = x[:m] @ w.t()
            part32 = torch.matmul(x[:m].float(), w.float().t())
            eq = (part.view(torch.int16) == full[:m].view(torch.int16)).float().mean().item()
            mu = ulps(part, full[:m]).max().item()
            eq32 = (part32 == full32[:m]).float().mean().item()
            rel = ((part32 - full32[:m]).abs() / full32[:m].abs().clamp_min(1e-30)).max().item()
            print(f"{k:>6} {n:>6} {m:>5}  {eq:>10.4f} {mu:>8.0f}  {eq32:>9.4f} {rel:>9.2e}")


if __name__ == "__main__":
    main()
