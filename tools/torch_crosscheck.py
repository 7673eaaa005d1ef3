#!/usr/bin/env python3
"""Cross-check fourbit's transformer against an independent PyTorch implementation.

fourbit writes one training step of a small dense and a small MoE model (`fourbit model-dump`:
weights, a seeded batch, losses, logits, every gradient and the MoE routing; see
src/model/dump.h). This script rebuilds the same models in PyTorch (float64, autograd) from those
weights, runs the same batch, and compares the losses, the logits and every parameter gradient.

    python3 tools/torch_crosscheck.py                      # dumps with build*/src/cli/fourbit, cpu f64
    python3 tools/torch_crosscheck.py --device cuda        # the CUDA model (bf16 activations)
    python3 tools/torch_crosscheck.py --dump DIR [DIR...]  # compare existing dump folders

Needs torch and numpy (not a fourbit dependency). Exit code 0 when every comparison is within its
tolerance. Tolerances (norm-wise relative error ||fourbit - torch|| / ||torch||): float64 dumps
1e-9 for losses and logits (two float64 implementations, different summation orders; norm_eps
enters fourbit's RMSNorm as an FP32 scalar: ~2e-10 on the logits here) and 1e-7 for
the gradients (the loss-gradient scale 1 / n_valid and the router-loss coefficients enter fourbit's
ops as FP32 scalars: a uniform relative error up to 2^-24; measured 3.2e-8); f32 dumps 1e-4; CUDA
(bf16 activations) 5e-2 for the logits and 1e-1 for the gradients.

The MoE routing: torch's own top-k selection is compared with fourbit's (it must agree on at least
98% of the expert ids, or differ in at most one: near-ties may break differently, and the CUDA
model's router reads BF16 activations; on the H200 one id in 64 flipped), then the forward and backward run with
fourbit's expert ids (routing replay), so that a flipped near-tie does not make the gradients
incomparable. The PyTorch model is written from the documented math (src/model/config.h,
src/ops/*.h), not from fourbit's code.
"""

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import torch

F64 = torch.float64

# The models dumped by default: (name, fourbit arguments).
CASES = [
    ("dense", ["--preset", "tiny", "--set", "n_layers=2", "--set", "tied_embeddings=false"]),
    ("moe", ["--preset", "moe-tiny", "--set", "n_layers=2", "--set", "moe.layers=[1]",
             "--set", "moe.n_shared_experts=1", "--set", "moe.aux_loss_coef=0.1",
             "--set", "moe.z_loss_coef=0.01"]),
]


def load_dump(folder):
    with open(os.path.join(folder, "manifest.json")) as f:
        m = json.load(f)
    files = m["files"]

    def arr(key, dtype):
        return np.fromfile(os.path.join(folder, files[key]), dtype=dtype)

    out_dtype = np.float64 if m["dtype"] == "f64" else np.float32
    data = {
        "params": arr("params", np.float32),
        "grads": arr("grads", out_dtype),
        "tokens": arr("tokens", np.int32).reshape(m["batch"], m["seq"]),
        "targets": arr("targets", np.int32).reshape(m["batch"], m["seq"]),
        "logits": arr("logits", out_dtype),
    }
    if "expert_ids" in files:
        data["expert_ids"] = arr("expert_ids", np.int32)
    return m, data


def unpack(manifest, flat):
    """name -> float64 tensor of its shape, from a flat array laid out like the manifest."""
    out = {}
    for p in manifest["params"]:
        n = int(np.prod(p["shape"]))
        out[p["name"]] = torch.tensor(flat[p["offset"]:p["offset"] + n], dtype=F64).reshape(p["shape"])
    return out


def rmsnorm(x, w, eps):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w


def rope(x, positions, theta):
    """Rotate-half RoPE of x [N, heads, D] at integer positions [N]."""
    d = x.shape[-1]
    inv_freq = theta ** (-2.0 * torch.arange(d // 2, dtype=F64) / d)
    angle = positions.to(F64)[:, None] * inv_freq[None, :]
    cos, sin = torch.cos(angle)[:, None, :], torch.sin(angle)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def attention(q, k, v, batch, seq):
    """Causal GQA attention. q [N, H, D], k, v [N, Hkv, D] -> [N, H * D]."""
    h, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    q = q.reshape(batch, seq, h, d).transpose(1, 2)
    k = k.reshape(batch, seq, hkv, d).transpose(1, 2).repeat_interleave(h // hkv, dim=1)
    v = v.reshape(batch, seq, hkv, d).transpose(1, 2).repeat_interleave(h // hkv, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    mask = torch.ones(seq, seq, dtype=torch.bool).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v
    return out.transpose(1, 2).reshape(batch * seq, h * d)


def swiglu_mlp(x, w_up, w_down):
    gu = x @ w_up.T
    f = gu.shape[-1] // 2
    return (torch.nn.functional.silu(gu[:, :f]) * gu[:, f:]) @ w_down.T


def moe_block(x, p, prefix, cfg, forced):
    """Softmax top-k routing with renormalized gates; returns (y, aux, z, selected ids)."""
    e, k = cfg["moe.n_experts"], cfg["moe.top_k"]
    logits = x @ p[prefix + "router.weight"].T
    probs = torch.softmax(logits, dim=-1)
    select = logits.detach().clone()
    if prefix + "router.bias" in p:
        select = select + p[prefix + "router.bias"].detach()
    # Descending, ties to the lower expert id (a stable sort of the negated scores).
    selected = torch.sort(-select, dim=-1, stable=True).indices[:, :k]
    ids = forced if forced is not None else selected
    g = probs.gather(1, ids)
    gates = g / g.sum(-1, keepdim=True)
    y = torch.zeros_like(x)
    w_up, w_down = p[prefix + "experts.up.weight"], p[prefix + "experts.down.weight"]
    for j in range(k):
        for ex in range(e):
            rows = (ids[:, j] == ex).nonzero().flatten()
            if rows.numel() == 0:
                continue
            y = y.index_add(0, rows, gates[rows, j:j + 1] * swiglu_mlp(x[rows], w_up[ex], w_down[ex]))
    if prefix + "shared.up.weight" in p:
        y = y + swiglu_mlp(x, p[prefix + "shared.up.weight"], p[prefix + "shared.down.weight"])
    counts = torch.bincount(ids.flatten(), minlength=e).to(F64)
    aux = e * (counts / x.shape[0] * probs.mean(0)).sum()
    z = (torch.logsumexp(logits, dim=-1) ** 2).mean()
    return y, aux, z, selected


def forward(p, cfg, tokens, targets, forced_ids):
    """The objective and its parts, the logits [N, V] and the selected expert ids per MoE block."""
    batch, seq = tokens.shape
    n = batch * seq
    c, h, hkv = cfg["d_model"], cfg["n_heads"], cfg["n_kv_heads"]
    d = c // h
    eps, theta = cfg["norm_eps"], cfg["rope_theta"]
    tok = torch.tensor(tokens.reshape(-1), dtype=torch.long)
    positions = torch.arange(seq).repeat(batch)
    x = p["embedding.weight"][tok]
    moe_layers = cfg["moe.layers"]
    aux_sum = z_sum = 0.0
    selected = []
    for l in range(cfg["n_layers"]):
        pre = f"blocks.{l}."
        hn = rmsnorm(x, p[pre + "attn_norm.weight"], eps)
        qkv = hn @ p[pre + "attn.qkv.weight"].T
        q = rope(qkv[:, : h * d].reshape(n, h, d), positions, theta)
        k = rope(qkv[:, h * d:(h + hkv) * d].reshape(n, hkv, d), positions, theta)
        v = qkv[:, (h + hkv) * d:].reshape(n, hkv, d)
        x = x + attention(q, k, v, batch, seq) @ p[pre + "attn.out.weight"].T
        hn = rmsnorm(x, p[pre + "mlp_norm.weight"], eps)
        if l in moe_layers:
            mi = moe_layers.index(l)
            forced = None if forced_ids is None else forced_ids[:, mi, :]
            y, aux, z, sel = moe_block(hn, p, pre + "moe.", cfg, forced)
            aux_sum, z_sum = aux_sum + aux, z_sum + z
            selected.append(sel)
            x = x + y
        else:
            x = x + swiglu_mlp(hn, p[pre + "mlp.up.weight"], p[pre + "mlp.down.weight"])
    x = rmsnorm(x, p["final_norm.weight"], eps)
    head = p["embedding.weight"] if cfg["tied_embeddings"] else p["lm_head.weight"]
    logits = x @ head.T
    tgt = torch.tensor(targets.reshape(-1), dtype=torch.long)
    ce = torch.nn.functional.cross_entropy(logits, tgt, ignore_index=-1) if (tgt >= 0).any() else logits.sum() * 0
    n_moe = max(len(moe_layers), 1)
    aux, z = aux_sum / n_moe, z_sum / n_moe
    loss = ce + cfg["moe.z_loss_coef"] * z
    if cfg["moe.load_balancing"] == "aux_loss":
        loss = loss + cfg["moe.aux_loss_coef"] * aux
    return loss, ce, aux, z, logits, selected


def rel_err(got, want):
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    ref = np.linalg.norm(want)
    return float(np.linalg.norm(got - want) / (ref if ref > 0 else 1.0))


def compare(folder):
    m, data = load_dump(folder)
    cfg = m["config"]
    exact = m["dtype"] == "f64"
    tol_logits = 1e-9 if exact else (1e-4 if m["device"] == "cpu" else 5e-2)
    tol_grads = 1e-7 if exact else (1e-4 if m["device"] == "cpu" else 1e-1)
    print(f"== {folder}: model {cfg['name']} on {m['device']} ({m['dtype']}), recipe {m['recipe']}, "
          f"batch {m['batch']} x {m['seq']}")
    if m["recipe"] != "bf16":
        print("   note: a quantized recipe; PyTorch runs unquantized, so expect the quantization error")
    params = unpack(m, data["params"])
    trainable = {q["name"] for q in m["params"] if q["trainable"]}
    for name, t in params.items():
        if name in trainable:
            t.requires_grad_(True)
    n = m["batch"] * m["seq"]
    forced = None
    if cfg["moe.layers"]:
        forced = torch.tensor(data["expert_ids"].reshape(n, len(cfg["moe.layers"]), cfg["moe.top_k"]),
                              dtype=torch.long)
    loss, ce, aux, z, logits, selected = forward(params, cfg, data["tokens"], data["targets"], forced)
    loss.backward()
    failures = []

    def check(what, err, tol):
        status = "ok" if err <= tol else "FAIL"
        print(f"   {what:<44} {err:.3e}  (tolerance {tol:.0e}) {status}")
        if err > tol:
            failures.append(what)

    ref = m["loss"]
    for key, value in (("loss", loss), ("ce", ce), ("aux", aux), ("z", z)):
        v = float(value.detach()) if torch.is_tensor(value) else float(value)
        check(f"loss.{key} (fourbit {ref[key]:.9f}, torch {v:.9f})",
              abs(ref[key] - v) / max(abs(v), 1e-12), tol_logits)
    check("logits", rel_err(data["logits"], logits.detach().numpy().reshape(-1)), tol_logits)
    if forced is not None:
        own = torch.stack(selected, dim=1)
        agree = float((own == forced).double().mean())
        flips = int((own != forced).sum())
        print(f"   routing: torch's own top-k equals fourbit's for {agree:.4f} of the expert ids ({flips} differ)")
        if agree < 0.98 and flips > 1:
            failures.append("routing")
    grads = unpack(m, data["grads"])
    for q in m["params"]:
        if not q["trainable"]:
            continue
        g = params[q["name"]].grad
        g = torch.zeros_like(params[q["name"]]) if g is None else g
        check("grad " + q["name"], rel_err(grads[q["name"]].numpy(), g.numpy()), tol_grads)
    return failures


def find_fourbit(root):
    for build in ("build-gpu", "build", "build-cuda", "build-cpu"):
        path = os.path.join(root, build, "src", "cli", "fourbit")
        if os.access(path, os.X_OK):
            return path
    return None


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fourbit", help="the fourbit binary (default: build-gpu/, build/, ... under the repo)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where fourbit runs the step")
    ap.add_argument("--dtype", default="f64", choices=["f64", "f32"], help="fourbit's CPU dtype")
    ap.add_argument("--recipe", default="bf16", help="fourbit's recipe preset (quantized ones differ by design)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--keep", help="write the dumps under this folder and keep them")
    ap.add_argument("--dump", nargs="+", help="compare these existing dump folders instead")
    args = ap.parse_args()
    torch.set_default_dtype(F64)

    folders = args.dump or []
    tmp = None
    if not folders:
        fourbit = args.fourbit or find_fourbit(root)
        if not fourbit:
            sys.exit("torch_crosscheck: no fourbit binary found; build it (tools/test.sh or "
                     "tools/gpu-test.sh) or pass --fourbit")
        base = args.keep or tempfile.mkdtemp(prefix="fourbit-crosscheck-")
        tmp = None if args.keep else base
        for name, case_args in CASES:
            out = os.path.join(base, name)
            cmd = [fourbit, "model-dump", *case_args, "--device", args.device, "--dtype", args.dtype,
                   "--recipe", args.recipe, "--batch", str(args.batch), "--seq", str(args.seq), "--out", out]
            print("$ " + " ".join(cmd))
            subprocess.run(cmd, check=True)
            folders.append(out)
    failures = []
    for folder in folders:
        failures += [f"{folder}: {f}" for f in compare(folder)]
    if tmp:
        shutil.rmtree(tmp, ignore_errors=True)
    if failures:
        print(f"torch_crosscheck: FAIL ({len(failures)}): " + "; ".join(failures))
        return 1
    print("torch_crosscheck: PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
