#!/usr/bin/env python3
"""Cross-check of fourbit's Hugging Face export: the exported checkpoint, loaded by transformers
(or, where transformers is missing, by an independent Llama / Mixtral forward written here), must
give the logits fourbit computed for the same weights and tokens.

One command (runs `fourbit export --reference-logits` for a dense model (Llama), an all-MoE model
(Mixtral) and an MoE model with dense blocks and a shared expert (Qwen2-MoE), in F32 and in NVIDIA
ModelOpt's NVFP4 layout, then checks all six):

    python3 tools/hf_crosscheck.py                       # finds build*/src/cli/fourbit
    python3 tools/hf_crosscheck.py --fourbit PATH --device cuda --keep OUT_DIR

An NVFP4 export (ModelOpt layout) is checked by dequantizing it here (own E2M1 / E4M3 decoders,
low nibble first, e2m1 * weight_scale * weight_scale_2) and running the fallback forward, against
fourbit's logits of the same dequantized weights (--format nvfp4).

Or check one export made by hand:

    fourbit export --preset tiny --format f32 --reference-logits --out /tmp/tiny-hf
    python3 tools/hf_crosscheck.py --dir /tmp/tiny-hf

What is compared: OUT/fourbit_reference/logits.f64 (fourbit's CPU float64 forward of the exported
weights, a plain recipe; interchange/hf.h write_reference_logits) against the logits of the
exported checkpoint on OUT/fourbit_reference/tokens.i32, in float64. Reported: the largest
absolute difference, the largest |logit|, and whether the argmax agrees everywhere.
Tolerances: transformers computes the RoPE angles and the RMSNorm statistics in float32 even in a
float64 model, so its logits differ by ~1e-6 relative; the pass bound is 1e-4 * max(1, max|logit|).
The fallback forward is float64 throughout: bound 1e-8 * max(1, max|logit|).

The fallback (used when `import transformers` fails; it says so) is written from the
architectures' definitions, not from fourbit's code: RMSNorm (x / sqrt(mean(x^2) + eps) * w),
rotate-half RoPE, causal grouped-query attention (+ q/k/v biases where the file has them), SwiGLU
MLP, Mixtral's router (softmax over the experts, top-k, renormalized) and Qwen2-MoE's (the same
with norm_topk_prob, mlp_only_layers, and the shared expert scaled by sigmoid(shared_expert_gate x)). It runs on PyTorch when it is installed, else on NumPy.
The safetensors file is parsed here (no safetensors package needed).
"""
import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- files --------------------------------------------------------------------------------------

def read_safetensors(path):
    """name -> float64 numpy array (F32, F64, BF16, F16)."""
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    data = memoryview(blob)[8 + n:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        raw = data[b:e]
        dt = info["dtype"]
        if dt == "F32":
            a = np.frombuffer(raw, dtype="<f4").astype(np.float64)
        elif dt == "F64":
            a = np.frombuffer(raw, dtype="<f8").copy()
        elif dt == "F16":
            a = np.frombuffer(raw, dtype="<f2").astype(np.float64)
        elif dt == "BF16":
            a = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        elif dt in ("U8", "F8_E4M3"):  # NVFP4 packed weights and block scales: raw codes
            a = np.frombuffer(raw, dtype=np.uint8).copy()
        else:
            raise SystemExit(f"{path}: tensor {name} has dtype {dt}, which this cross-check does not read")
        out[name] = a.reshape(info["shape"])
    return out


E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)


def decode_e2m1(codes):
    v = E2M1[codes & 7]
    return np.where(codes & 8, -v, v).astype(np.float32)


def decode_e4m3(codes):
    """OCP FP8 E4M3 ("fn"): bias 7, subnormals, S.1111.111 = NaN."""
    c = codes.astype(np.int32)
    sign = np.where(c & 0x80, -1.0, 1.0)
    e, m = (c >> 3) & 0xF, c & 7
    v = np.where(e == 0, m / 8.0 * 2.0 ** -6, (1.0 + m / 8.0) * np.exp2(e - 7.0))
    v = np.where((c & 0x7F) == 0x7F, np.nan, v)
    return (sign * v).astype(np.float32)


def dequantize_modelopt_nvfp4(W):
    """ModelOpt NVFP4 modules (weight U8 packed E2M1 low nibble first, weight_scale E4M3 per 16,
    weight_scale_2 F32) -> float64 weights: e2m1 * weight_scale * weight_scale_2, the products
    rounded to float32 as a float32 dequantization does."""
    out = {}
    for name, a in W.items():
        if name.endswith(".weight_scale") or name.endswith(".weight_scale_2") or name.endswith(".input_scale"):
            continue
        module = name[:-len(".weight")] if name.endswith(".weight") else None
        if module and module + ".weight_scale" in W:
            rows, half = a.shape
            codes = np.empty((rows, 2 * half), dtype=np.uint8)
            codes[:, 0::2] = a & 0xF
            codes[:, 1::2] = a >> 4
            scale = np.repeat(decode_e4m3(W[module + ".weight_scale"]), 16, axis=1)
            scale2 = np.float32(W[module + ".weight_scale_2"])
            out[name] = ((decode_e2m1(codes) * scale) * scale2).astype(np.float64)
        else:
            out[name] = a
    return out


def load_reference(export_dir):
    ref_dir = os.path.join(export_dir, "fourbit_reference")
    with open(os.path.join(ref_dir, "reference.json")) as f:
        ref = json.load(f)
    B, T, V = ref["batch"], ref["seq"], ref["vocab"]
    tokens = np.fromfile(os.path.join(ref_dir, ref["tokens"]), dtype="<i4").reshape(B, T)
    logits = np.fromfile(os.path.join(ref_dir, ref["logits"]), dtype="<f8").reshape(B, T, V)
    return ref, tokens, logits


# ---- the independent forward --------------------------------------------------------------------

class Np:
    name = "numpy"

    @staticmethod
    def arr(a):
        return np.asarray(a, dtype=np.float64)

    @staticmethod
    def out(a):
        return np.asarray(a)

    @staticmethod
    def ids(tokens):
        return np.asarray(tokens, dtype=np.int64)

    exp, sqrt, cos, sin = np.exp, np.sqrt, np.cos, np.sin

    @staticmethod
    def cat(xs, axis):
        return np.concatenate(xs, axis=axis)

    @staticmethod
    def topk(x, k):  # descending, ties to the lower index
        idx = np.argsort(-x, axis=-1, kind="stable")[..., :k]
        return np.take_along_axis(x, idx, axis=-1), idx


class Torch:
    name = "torch"

    def __init__(self, device):
        import torch
        self.t = torch
        self.device = device
        self.exp, self.sqrt, self.cos, self.sin = torch.exp, torch.sqrt, torch.cos, torch.sin

    def arr(self, a):
        return self.t.as_tensor(np.asarray(a, dtype=np.float64), device=self.device)

    def out(self, a):
        return a.detach().cpu().numpy()

    def ids(self, tokens):
        return self.t.as_tensor(np.asarray(tokens, dtype=np.int64), device=self.device)

    def cat(self, xs, axis):
        return self.t.cat(xs, dim=axis)

    def topk(self, x, k):
        v, i = self.t.topk(x, k, dim=-1)
        return v, i


def softmax(xp, x):
    m = x.max(-1, keepdims=True) if xp.name == "numpy" else x.max(-1, keepdim=True).values
    e = xp.exp(x - m)
    return e / e.sum(-1, keepdims=True) if xp.name == "numpy" else e / e.sum(-1, keepdim=True)


def mean_last(xp, x):
    return x.mean(-1, keepdims=True) if xp.name == "numpy" else x.mean(-1, keepdim=True)


def rmsnorm(xp, x, w, eps):
    return x / xp.sqrt(mean_last(xp, x * x) + eps) * w


def rope(xp, x, theta):  # x [T, heads, D], rotate-half pairs (i, i + D/2)
    T, _, D = x.shape
    half = D // 2
    inv = xp.arr(theta ** (-np.arange(half, dtype=np.float64) * 2.0 / D))
    pos = xp.arr(np.arange(T, dtype=np.float64))
    ang = pos[:, None] * inv[None, :]
    c, s = xp.cos(ang)[:, None, :], xp.sin(ang)[:, None, :]
    a, b = x[..., :half], x[..., half:]
    return xp.cat([a * c - b * s, b * c + a * s], -1)


def silu(xp, x):
    return x / (1.0 + xp.exp(-x))


def forward(xp, cfg, W, tokens):
    """Logits [T, V] of one sequence (float64)."""
    C, H = cfg["hidden_size"], cfg["num_attention_heads"]
    Hkv = cfg.get("num_key_value_heads", H)
    D = C // H
    eps, theta = cfg["rms_norm_eps"], cfg.get("rope_theta", 10000.0)
    kind = cfg["model_type"]  # llama, mixtral, qwen2_moe
    T = len(tokens)
    x = W["model.embed_tokens.weight"][xp.ids(tokens)]
    mask = np.triu(np.full((T, T), -np.inf), 1)
    mask = xp.arr(mask)
    for l in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{l}."
        h = rmsnorm(xp, x, W[p + "input_layernorm.weight"], eps)
        def proj(n):  # Qwen2's q/k/v projections have biases
            y = h @ W[p + f"self_attn.{n}_proj.weight"].T
            return y + W[p + f"self_attn.{n}_proj.bias"] if p + f"self_attn.{n}_proj.bias" in W else y
        q = proj("q").reshape(T, H, D)
        k = proj("k").reshape(T, Hkv, D)
        v = proj("v").reshape(T, Hkv, D)
        q, k = rope(xp, q, theta), rope(xp, k, theta)
        heads = []
        for hh in range(H):
            g = hh // (H // Hkv)
            s = (q[:, hh, :] @ k[:, g, :].T) / np.sqrt(D) + mask
            heads.append(softmax(xp, s) @ v[:, g, :])
        a = xp.cat(heads, -1)
        x = x + a @ W[p + "self_attn.o_proj.weight"].T
        h = rmsnorm(xp, x, W[p + "post_attention_layernorm.weight"], eps)
        def mlp(prefix, hh, gate="gate_proj", up="up_proj", down="down_proj"):
            return (silu(xp, hh @ W[prefix + gate + ".weight"].T) * (hh @ W[prefix + up + ".weight"].T)) @ \
                W[prefix + down + ".weight"].T

        def sparse(router, expert_prefix, names, renormalize):
            """softmax over the experts, top-k, optionally renormalized; sum of gate * expert(x)."""
            probs = softmax(xp, h @ W[router].T)
            top, idx = xp.topk(probs, cfg["num_experts_per_tok"])
            if renormalize:
                top = top / (top.sum(-1, keepdims=True) if xp.name == "numpy" else top.sum(-1, keepdim=True))
            idx = np.asarray(xp.out(idx))
            rows = []
            for t in range(T):
                acc = 0.0
                for j in range(idx.shape[1]):
                    acc = acc + top[t, j] * mlp(f"{expert_prefix}{int(idx[t, j])}.", h[t:t + 1], *names)
                rows.append(acc)
            return xp.cat(rows, 0)

        if kind == "llama":
            y = mlp(p + "mlp.", h)
        elif kind == "mixtral":
            m = p + "block_sparse_moe."
            y = sparse(m + "gate.weight", m + "experts.", ("w1", "w3", "w2"), True)
        elif kind == "qwen2_moe":
            dense = l in cfg.get("mlp_only_layers", []) or cfg.get("num_experts", 0) == 0 or \
                (l + 1) % cfg.get("decoder_sparse_step", 1) != 0
            if dense:
                y = mlp(p + "mlp.", h)
            else:
                m = p + "mlp."
                y = sparse(m + "gate.weight", m + "experts.", ("gate_proj", "up_proj", "down_proj"),
                           cfg.get("norm_topk_prob", False))
                g = h @ W[m + "shared_expert_gate.weight"].T  # [T, 1]
                y = y + (1.0 / (1.0 + xp.exp(-g))) * mlp(m + "shared_expert.", h)
        else:
            raise SystemExit(f"config.json: model_type {kind} is not one the cross-check knows")
        x = x + y
    x = rmsnorm(xp, x, W["model.norm.weight"], eps)
    head = W["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings") else W["lm_head.weight"]
    return xp.out(x @ head.T)


def fallback_logits(export_dir, tokens, device):
    with open(os.path.join(export_dir, "config.json")) as f:
        cfg = json.load(f)
    try:
        xp = Torch(device)
    except ImportError:
        print("  PyTorch not installed either: the fallback forward runs on NumPy")
        xp = Np()
    raw = dequantize_modelopt_nvfp4(read_safetensors(os.path.join(export_dir, "model.safetensors")))
    W = {k: xp.arr(v) for k, v in raw.items()}
    return np.stack([forward(xp, cfg, W, tokens[b]) for b in range(tokens.shape[0])]), f"fallback ({xp.name}, float64)"


def transformers_logits(export_dir, tokens, device):
    import torch
    from transformers import AutoModelForCausalLM
    import transformers
    ids = torch.as_tensor(tokens, dtype=torch.long, device=device)
    # float64 first. transformers 5.x runs MoE experts through torch's grouped_mm, which refuses
    # float64 (seen with 5.17 on the device machine): then the eager experts, then float32 (the
    # pass bound, 1e-4 * max|logit|, already allows float32 arithmetic).
    attempts = [(torch.float64, {"experts_implementation": "eager"}), (torch.float64, {}), (torch.float32, {})]
    errors = []
    for dtype, extra in attempts:
        try:
            model = AutoModelForCausalLM.from_pretrained(export_dir, dtype=dtype, attn_implementation="eager",
                                                         **extra).to(device)
            model.eval()
            with torch.no_grad():
                out = model(ids).logits
        except (RuntimeError, TypeError, ValueError) as e:
            errors.append(f"{dtype} {extra}: {str(e).splitlines()[0][:120]}")
            continue
        how = f"transformers {transformers.__version__} ({type(model).__name__}, {str(dtype).replace('torch.', '')}"
        how += (", eager experts)" if extra else ")")
        if errors:
            print("  (transformers refused: " + "; ".join(errors) + ")")
        return out.double().cpu().numpy(), how
    raise RuntimeError("transformers could not run the export: " + "; ".join(errors))


def check_tokenizer(export_dir):
    """The exported byte-level tokenizer maps text to its bytes (and <|endoftext|> to 256)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        print("  tokenizer: the tokenizers package is not installed; not checked")
        return True
    tok = Tokenizer.from_file(os.path.join(export_dir, "tokenizer.json"))
    text = "count from 7 to 9: 7 8 9\n12+34=46\n\u00e9\t~"
    ids = tok.encode(text).ids
    want = list(text.encode("utf-8"))
    with open(os.path.join(export_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    ok = ids == want and tok.decode(ids) == text
    if vocab >= 257:
        ok = ok and tok.encode("a<|endoftext|>b").ids == [97, 256, 98]
    print(f"  tokenizer: byte ids {'match' if ok else 'DIFFER: ' + str(ids[:20])} -> {'PASS' if ok else 'FAIL'}")
    return ok


def check(export_dir, device, force_fallback):
    ref, tokens, want = load_reference(export_dir)
    got, how = None, None
    if os.path.exists(os.path.join(export_dir, "hf_quant_config.json")) and not force_fallback:
        print("  an NVFP4 (ModelOpt) export: transformers does not run it; the fallback forward dequantizes it")
        force_fallback = True
    if not force_fallback:
        try:
            got, how = transformers_logits(export_dir, tokens, device)
        except ImportError as e:
            print(f"  transformers (or PyTorch) is not installed ({e}); using the fallback forward written in "
                  f"this script")
    if got is None:
        got, how = fallback_logits(export_dir, tokens, device)
    tol = 1e-4 if how.startswith("transformers") else 1e-8
    diff = float(np.max(np.abs(got - want)))
    scale = float(np.max(np.abs(want)))
    argmax = float(np.mean(np.argmax(got, -1) == np.argmax(want, -1)))
    ok = diff <= tol * max(1.0, scale) and got.shape == want.shape
    print(f"  {how}: tokens {tokens.shape[0]}x{tokens.shape[1]}, weights {ref['weights']}: max |logit diff| "
          f"{diff:.3e} (max |logit| {scale:.3f}, bound {tol * max(1.0, scale):.1e}), argmax agreement "
          f"{argmax * 100:.2f}% -> {'PASS' if ok else 'FAIL'}")
    if os.path.exists(os.path.join(export_dir, "tokenizer.json")):
        ok = check_tokenizer(export_dir) and ok
    return ok


def find_fourbit():
    for d in ("build-gpu", "build", "build-cpu", "build-audit"):
        p = os.path.join(ROOT, d, "src", "cli", "fourbit")
        if os.access(p, os.X_OK):
            return p
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", help="check this export (made with --reference-logits) instead of making two")
    ap.add_argument("--fourbit", help="the fourbit binary (default: build-gpu/, build/, ... under the repo)")
    ap.add_argument("--device", default="cpu", help="torch device for transformers / the fallback")
    ap.add_argument("--fallback", action="store_true", help="skip transformers, use the script's own forward")
    ap.add_argument("--format", default="f32", choices=["f32", "bf16", "nvfp4"], help="export format to check "
                    "(nvfp4: the ModelOpt layout, dequantized by this script, fallback forward only)")
    ap.add_argument("--ref-batch", type=int, default=2, help="sequences of the reference batch")
    ap.add_argument("--ref-seq", type=int, default=64, help="tokens per sequence of the reference batch")
    ap.add_argument("--no-nvfp4", action="store_true", help="skip the two NVFP4 exports of the default run")
    ap.add_argument("--keep", help="write the exports here (default: a temporary folder, removed)")
    args = ap.parse_args()
    if args.dir:
        print(f"{args.dir}:")
        sys.exit(0 if check(args.dir, args.device, args.fallback) else 1)
    fourbit = args.fourbit or find_fourbit()
    if not fourbit:
        sys.exit("no fourbit binary found; build it (tools/test.sh) or pass --fourbit PATH")
    work = args.keep or tempfile.mkdtemp(prefix="fourbit_hf_crosscheck_")
    dense, moe = ["--preset", "tiny"], ["--preset", "moe-tiny", "--set", "moe.layers=all"]
    # moe-tiny as it is (MoE blocks 1 and 3 only) with a shared expert: the Qwen2-MoE export
    qwen = ["--preset", "moe-tiny", "--set", "moe.n_shared_experts=1"]
    cases = [("dense", dense, args.format), ("moe", moe, args.format), ("moe-qwen2", qwen, args.format)]
    if args.format != "nvfp4" and not args.no_nvfp4:
        cases += [("dense-nvfp4", dense + ["--recipe", "nvfp4"], "nvfp4"),
                  ("moe-nvfp4", moe + ["--recipe", "nvfp4"], "nvfp4"),
                  ("moe-qwen2-nvfp4", qwen + ["--recipe", "nvfp4"], "nvfp4")]
    ok = True
    try:
        for name, model_args, fmt in cases:
            out = os.path.join(work, name)
            cmd = [fourbit, "export", *model_args, "--format", fmt, "--reference-logits", "--ref-batch",
                   str(args.ref_batch), "--ref-seq", str(args.ref_seq), "--out", out]
            if fmt == "nvfp4":  # input-scale calibration on a batch of the reference's size
                cmd += ["--calib-batch", str(args.ref_batch), "--calib-seq", str(args.ref_seq)]
            print(f"{name}: {' '.join(cmd)}")
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                print(r.stdout + r.stderr)
                sys.exit(f"{name}: fourbit export failed")
            ok = check(out, args.device, args.fallback) and ok
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print("hf_crosscheck: " + ("PASS" if ok else "FAIL"))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
