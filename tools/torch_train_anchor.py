#!/usr/bin/env python3
"""The PyTorch training-step anchor of BENCHMARKS.md, measured on the machine at hand.

BENCHMARKS.md's bf16 target is a ratio: fourbit's gpt2-124m training step at >= 1.1x the tokens/s of
"PyTorch + torch.compile, SDPA flash attention, fused AdamW" at the GPT-2 124M shape (12 layers,
d 768, T 1024, B 32). Its 517k tokens/s were measured on an H200; the device tool often lends an
H100 instead, where that absolute figure means nothing. This script measures the anchor itself, so
that the ratio can be taken against a fourbit run on the same machine in the same call:

    python3 tools/torch_train_anchor.py                     # both architectures below
    python3 tools/torch_train_anchor.py --arch gpt2 --steps 20
    python3 tools/torch_train_anchor.py --csv anchor.csv   # also one CSV row per architecture

Two architectures, both trained in BF16 autocast over FP32 master weights with fused AdamW:
  gpt2     nanoGPT's GPT-2 small: learned positions, LayerNorm with biases, GELU(tanh) MLP of 4d,
           biased linears, tied embeddings, vocabulary 50304 (the anchor as BENCHMARKS.md names it)
  fourbit  fourbit's gpt2-124m preset (src/model/config.cpp): RMSNorm without biases, RoPE
           (theta 1e4, rotate-half pairs), SwiGLU with d_ff 2048, no linear biases, tied embeddings, vocabulary
           50304: the same FLOPs as the fourbit step it is compared with

Random tokens (fixed batch), warm-up steps (compilation included) not timed, then the median of
per-step wall times with a device synchronisation per step (as fourbit's `bench train`, whose
steps synchronise on the gradient norm). Prints one line per architecture: ms/step, tokens/s, peak
memory. Needs torch with CUDA (not a fourbit dependency).
"""

import argparse
import csv
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, arch, d, n_heads, d_ff, T):
        super().__init__()
        self.arch, self.n_heads = arch, n_heads
        bias = arch == "gpt2"
        if arch == "gpt2":
            self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.fc = nn.Linear(d, d_ff, bias=True)
        else:
            self.norm1, self.norm2 = nn.RMSNorm(d, eps=1e-5), nn.RMSNorm(d, eps=1e-5)
            self.fc = nn.Linear(d, 2 * d_ff, bias=False)  # gate and up in one matrix
        self.qkv = nn.Linear(d, 3 * d, bias=bias)
        self.proj = nn.Linear(d, d, bias=bias)
        self.down = nn.Linear(d_ff, d, bias=bias)
        if arch == "fourbit":
            hd = d // n_heads
            inv = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
            ang = torch.outer(torch.arange(T, dtype=torch.float32), inv)  # [T, hd/2]
            self.register_buffer("cos", ang.cos(), persistent=False)
            self.register_buffer("sin", ang.sin(), persistent=False)

    def rope(self, x):  # x: [B, H, T, hd]; "rotate half": dimension i pairs with i + hd/2
        T = x.shape[2]
        x1, x2 = x.float().chunk(2, dim=-1)
        c, s = self.cos[:T], self.sin[:T]
        return torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).type_as(x)

    def forward(self, x):  # x: [B, T, d]
        B, T, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        q, k, v = (t.view(B, T, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        if self.arch == "fourbit":
            q, k = self.rope(q), self.rope(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, d))
        h = self.fc(self.norm2(x))
        if self.arch == "gpt2":
            h = F.gelu(h, approximate="tanh")
        else:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        return x + self.down(h)


class Model(nn.Module):
    def __init__(self, arch, vocab=50304, d=768, n_layers=12, n_heads=12, T=1024):
        super().__init__()
        self.arch = arch
        d_ff = 4 * d if arch == "gpt2" else 2048
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(T, d) if arch == "gpt2" else None
        self.blocks = nn.ModuleList(Block(arch, d, n_heads, d_ff, T) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d) if arch == "gpt2" else nn.RMSNorm(d, eps=1e-5)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens, targets):  # tokens, targets: [B, T] int64
        x = self.wte(tokens)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


def measure(arch, B, T, warmup, steps, compile_model):
    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = Model(arch, T=T).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": other, "weight_decay": 0.0}],
                            lr=6e-4, betas=(0.9, 0.95), fused=True)
    step_model = torch.compile(model) if compile_model else model
    tokens = torch.randint(0, 50304, (B, T), device=dev)
    targets = torch.randint(0, 50304, (B, T), device=dev)
    times = []
    t_compile = time.perf_counter()
    for s in range(warmup + steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = step_model(tokens, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if s == warmup - 1:
            t_compile = time.perf_counter() - t_compile
            torch.cuda.reset_peak_memory_stats()
        if s >= warmup:
            times.append(time.perf_counter() - t0)
    ms = 1e3 * statistics.median(times)
    peak = torch.cuda.max_memory_allocated() / 2**30
    row = {"arch": arch, "batch": B, "seq_len": T, "step_ms": f"{ms:.3f}",
           "tokens_per_s": f"{B * T / (ms / 1e3):.0f}", "peak_gib": f"{peak:.3f}",
           "params_m": f"{n_params / 1e6:.1f}", "torch": torch.__version__,
           "mode": "compiled" if compile_model else "eager", "gpu": torch.cuda.get_device_name()}
    print(f"torch anchor {arch:8s} B {B} T {T}: {ms:.2f} ms/step, {B * T / (ms / 1e3):.0f} tokens/s, "
          f"peak {peak:.2f} GiB, {n_params / 1e6:.1f}M parameters, loss {loss.item():.4f}, "
          f"warm-up {t_compile:.1f} s (torch {torch.__version__}, "
          f"{'compiled' if compile_model else 'eager'}, {torch.cuda.get_device_name()})", flush=True)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", default="gpt2,fourbit", help="gpt2, fourbit, or both comma-separated")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--eager", action="store_true", help="no torch.compile")
    ap.add_argument("--csv", help="also write the figures to this CSV file (one row per architecture)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("torch_train_anchor: torch sees no CUDA device; this anchor is a GPU figure")
    torch.backends.cuda.matmul.allow_tf32 = True
    archs = a.arch.split(",")
    for arch in archs:
        if arch not in ("gpt2", "fourbit"):
            raise SystemExit(f"torch_train_anchor: --arch '{arch}' is neither gpt2 nor fourbit")
    rows = [measure(arch, a.batch, a.seq, a.warmup, a.steps, not a.eager) for arch in archs]
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
            w.writeheader()
            w.writerows(rows)


if __name__ == "__main__":
    main()
