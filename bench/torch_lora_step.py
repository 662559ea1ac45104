#!/usr/bin/env python3
"""PyTorch reference for bench_train: the same LoRA training step, written as a PyTorch user would.

    /usr/bin/python3 bench/torch_lora_step.py [--shape small|2b] [--layers N] [--threads 2]
        [--steps 5] [--warmup 1] [--batch 2] [--seq-len 128] [--rank 4] [--lr 1e-4]
    /usr/bin/python3 bench/torch_lora_step.py --check DUMP.safetensors   # vs bench_train --dump

Model: the Gemma (1) decoder in float32 — embedding lookup × sqrt(D) (tied with the output
projection), per block RMSNorm with (1 + scale), q/k/v projections, RoPE (rotate-half, base 1e4),
query scaling 1/sqrt(query_scale_dim) after RoPE, multi-query attention (keys/values repeated over
the query heads as Hugging Face's repeat_kv does) with a causal mask and fp32 softmax, the output
projection, residual, RMSNorm, GeGLU (gelu tanh approximation) feed-forward, residual; final
RMSNorm, logits = h·Eᵀ over all [B·T, V] rows, loss = F.cross_entropy(reduction='sum') / (B·T)
(all sample weights are 1, so this is Σ w·CE / (B·T), Keras' sum_over_batch_size).

LoRA: Keras style (what meshtune's enable_lora creates), rank r on query and value:
A has the kernel's shape but the last axis — (N, D, r) for query, (K, D, r) for value — and B is
(r, H), shared by the heads; scale = alpha / r = 1. It is run the PEFT way, as an extra low-rank
path next to the frozen base projection: q = x·Wqᵀ + scale·((x·A)·B) per head. Base weights and
the embedding have requires_grad=False; only A and B train, with torch.optim.AdamW (lr 1e-4,
weight decay 0.01, eps 1e-7).

Prints one JSON line with the same keys as bench_train (ms_per_step is the median over --steps
timed steps after --warmup untimed ones; peak RSS from resource.getrusage). See bench/README.md.
"""
import argparse
import json
import math
import os
import resource
import struct
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F


def config(shape, layers):
    if shape == "small":  # preset_config("tiny", 1000)
        c = dict(vocab=1000, hidden=64, layers=2, heads=4, kv_heads=1, head_dim=16, ffw=128, query_scale_dim=16)
    else:  # Gemma 2B
        c = dict(vocab=256000, hidden=2048, layers=18, heads=8, kv_heads=1, head_dim=256, ffw=16384,
                 query_scale_dim=256)
    if layers:
        c["layers"] = layers
    return c


def num_parameters(c):
    D, N, K, H, F_ = c["hidden"], c["heads"], c["kv_heads"], c["head_dim"], c["ffw"]
    per_layer = D * N * H + 2 * D * K * H + N * H * D + 3 * D * F_ + 2 * D
    return c["vocab"] * D + c["layers"] * per_layer + D


def count_flops(c, B, T, r):
    """The same count as bench_train.cpp (see bench/README.md): forward and backward model FLOPs."""
    M, D, N, K, H = B * T, c["hidden"], c["heads"], c["kv_heads"], c["head_dim"]
    F_, V, L = c["ffw"], c["vocab"], c["layers"]
    P = D * N * H + 2 * D * K * H + N * H * D + 3 * D * F_
    matmul = 2.0 * M * (L * P + V * D)
    attention = L * 4.0 * B * N * H * (T * (T + 1) / 2)
    lora_path = L * 2.0 * M * r * (D * (N + K) + H * (N + K))
    forward = matmul + attention + lora_path
    backward = matmul + 2 * attention + 2 * lora_path
    return forward, backward


class Layer:
    pass


class GemmaLora:
    """Frozen fp32 Gemma weights (Hugging Face [out, in] layouts) plus trainable Keras-style LoRA."""

    def __init__(self, c, rank, gen):
        self.c, self.rank, self.scale = c, rank, 1.0  # alpha = rank
        D, N, K, H, F_, V = c["hidden"], c["heads"], c["kv_heads"], c["head_dim"], c["ffw"], c["vocab"]

        def normal(*shape, std):
            return torch.empty(*shape).normal_(0.0, std, generator=gen)

        self.embed = normal(V, D, std=1 / math.sqrt(D))
        self.layers = []
        for _ in range(c["layers"]):
            l = Layer()
            l.pre_attention_norm = normal(D, std=0.1)
            l.pre_ffw_norm = normal(D, std=0.1)
            l.q = normal(N * H, D, std=1 / math.sqrt(D))
            l.k = normal(K * H, D, std=1 / math.sqrt(D))
            l.v = normal(K * H, D, std=1 / math.sqrt(D))
            l.o = normal(D, N * H, std=1 / math.sqrt(N * H))
            l.gate = normal(F_, D, std=1 / math.sqrt(D))
            l.up = normal(F_, D, std=1 / math.sqrt(D))
            l.down = normal(D, F_, std=1 / math.sqrt(F_))
            # enable_lora: A ~ he_uniform(fan_in = prod(A.shape[:-1])); B small random (not 0) so that
            # every gradient is non-zero, as bench_train sets it.
            l.lora_q_a = torch.empty(N, D, rank).uniform_(-math.sqrt(6 / (N * D)), math.sqrt(6 / (N * D)), generator=gen)
            l.lora_q_b = normal(rank, H, std=0.01)
            l.lora_v_a = torch.empty(K, D, rank).uniform_(-math.sqrt(6 / (K * D)), math.sqrt(6 / (K * D)), generator=gen)
            l.lora_v_b = normal(rank, H, std=0.01)
            self.layers.append(l)
        self.final_norm = normal(D, std=0.1)
        self._setup()

    def _setup(self):
        c = self.c
        H = c["head_dim"]
        self.trainable = []
        for l in self.layers:
            for name in ("lora_q_a", "lora_q_b", "lora_v_a", "lora_v_b"):
                t = getattr(l, name).requires_grad_(True)
                self.trainable.append(t)
        self.inv_freq = 1.0 / (10000.0 ** (torch.arange(0, H, 2, dtype=torch.float32) / H))
        self.query_scale = torch.tensor(1.0 / math.sqrt(c["query_scale_dim"]), dtype=torch.float32)
        self.embed_scale = torch.tensor(math.sqrt(c["hidden"]), dtype=torch.float32)

    def rms_norm(self, x, scale):
        eps = 1e-6
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + scale)

    @staticmethod
    def rotate_half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def lora(self, h, a, b):
        """scale·(h·A)·B for Keras-style A [heads, D, r], B [r, H]: [B, T, heads·H]."""
        Bsz, T, D = h.shape
        heads, _, r = a.shape
        ha = (h.reshape(Bsz * T, D) @ a.permute(1, 0, 2).reshape(D, heads * r)).view(Bsz * T * heads, r)
        return (self.scale * (ha @ b)).view(Bsz, T, heads * b.shape[1])

    def loss(self, tokens, targets):
        c = self.c
        Bsz, T = tokens.shape
        D, N, K, H, V = c["hidden"], c["heads"], c["kv_heads"], c["head_dim"], c["vocab"]
        pos = torch.arange(T, dtype=torch.float32)
        freqs = torch.outer(pos, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]  # [1, 1, T, H]
        mask = torch.ones(T, T, dtype=torch.bool).triu(1)  # True = future key, masked
        x = F.embedding(tokens, self.embed) * self.embed_scale
        for l in self.layers:
            h = self.rms_norm(x, l.pre_attention_norm)
            q = F.linear(h, l.q) + self.lora(h, l.lora_q_a, l.lora_q_b)
            k = F.linear(h, l.k)
            v = F.linear(h, l.v) + self.lora(h, l.lora_v_a, l.lora_v_b)
            q = q.view(Bsz, T, N, H).transpose(1, 2)
            k = k.view(Bsz, T, K, H).transpose(1, 2)
            v = v.view(Bsz, T, K, H).transpose(1, 2)
            q = (q * cos + self.rotate_half(q) * sin) * self.query_scale
            k = k * cos + self.rotate_half(k) * sin
            if K != N:  # repeat_kv
                k = k[:, :, None].expand(Bsz, K, N // K, T, H).reshape(Bsz, N, T, H)
                v = v[:, :, None].expand(Bsz, K, N // K, T, H).reshape(Bsz, N, T, H)
            scores = torch.matmul(q, k.transpose(2, 3)).masked_fill(mask, float("-inf"))
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
            attended = torch.matmul(probs, v).transpose(1, 2).reshape(Bsz, T, N * H)
            x = x + F.linear(attended, l.o)
            h = self.rms_norm(x, l.pre_ffw_norm)
            x = x + F.linear(F.gelu(F.linear(h, l.gate), approximate="tanh") * F.linear(h, l.up), l.down)
        h = self.rms_norm(x, self.final_norm)
        logits = F.linear(h.reshape(Bsz * T, D), self.embed)  # [B·T, V]
        return F.cross_entropy(logits, targets.reshape(-1), reduction="sum") / (Bsz * T)


def peak_rss_gib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30


def cpu_times():
    with open("/proc/stat") as f:
        fields = [float(x) for x in f.readline().split()[1:9]]
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ((user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK"), ru.ru_utime + ru.ru_stime,
            time.perf_counter())


def foreign_cpus(a, b):
    return max(0.0, ((b[0] - a[0]) - (b[1] - a[1])) / (b[2] - a[2]))


def train(model, tokens, targets, lr, warmup, steps, on_first_step=None):
    opt = torch.optim.AdamW(model.trainable, lr=lr, betas=(0.9, 0.999), eps=1e-7, weight_decay=0.01)
    times, losses = [], []
    for step in range(warmup + steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model.loss(tokens, targets)
        loss.backward()
        opt.step()
        s = time.perf_counter() - t0
        losses.append(loss.item())
        if step >= warmup:
            times.append(s)
        if step == 0 and on_first_step:
            on_first_step()
        print(f"torch_lora_step: step {step}{' (warm-up)' if step < warmup else ''}: {s * 1e3:.1f} ms, "
              f"loss {losses[-1]:.6f}", file=sys.stderr)
    return times, losses


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    meta = header.pop("__metadata__", {})
    dtypes = {"F32": np.float32, "I32": np.int32}
    out = {}
    for name, info in header.items():
        a, b = info["data_offsets"]
        out[name] = torch.from_numpy(np.frombuffer(data[a:b], dtype=dtypes[info["dtype"]]).reshape(info["shape"]).copy())
    return out, meta


def check(path, threads):
    """Runs the same steps on bench_train --dump's weights and batch; compares losses and gradients."""
    t, meta = read_safetensors(path)
    L, V, D = int(meta["num_layers"]), int(meta["vocab_size"]), int(meta["hidden_dim"])
    q0, k0 = t["l0.q"], t["l0.k"]
    a0 = t["l0.lora_q_a"]
    N, r = a0.shape[0], a0.shape[2]
    H = q0.shape[0] // N
    c = dict(vocab=V, hidden=D, layers=L, heads=N, kv_heads=k0.shape[0] // H, head_dim=H, ffw=t["l0.gate"].shape[0],
             query_scale_dim=H)
    model = GemmaLora.__new__(GemmaLora)
    model.c, model.rank, model.scale = c, r, 1.0
    model.embed, model.final_norm, model.layers = t["embed"], t["final_norm"], []
    for i in range(L):
        l = Layer()
        for name in ("pre_attention_norm", "pre_ffw_norm", "q", "k", "v", "o", "gate", "up", "down", "lora_q_a",
                     "lora_q_b", "lora_v_a", "lora_v_b"):
            setattr(l, name, t[f"l{i}.{name}"])
        model.layers.append(l)
    model._setup()
    want_losses = t["losses"].tolist()
    grads = {}

    def keep_grads():
        for i, l in enumerate(model.layers):
            for which, slot in (("q", "query"), ("v", "value")):
                for ab in ("a", "b"):
                    grads[f"decoder_block_{i}/attention/{slot}/lora_kernel_{ab}"] = getattr(l, f"lora_{which}_{ab}").grad.clone()

    _, losses = train(model, t["tokens"].long(), t["targets"].long(), float(meta["lr"]), 0, len(want_losses),
                      keep_grads)
    # The first loss and the first step's gradients must agree to fp32 rounding. Later losses drift a
    # little: Keras' AdamW adds eps to sqrt(v) before the bias correction, PyTorch's after, and Adam's
    # normalised update turns rounding-level differences of tiny gradients into lr-sized steps.
    first_loss = abs(losses[0] - want_losses[0]) / abs(want_losses[0])
    worst_loss = max(abs(a - b) / abs(b) for a, b in zip(losses, want_losses))
    worst_grad = 0.0
    for name, g in grads.items():
        want = t["grad/" + name]
        worst_grad = max(worst_grad, ((g - want).abs().max() / want.abs().max()).item())
    ok = len(grads) == 4 * L and first_loss < 1e-5 and worst_grad < 1e-4 and worst_loss < 1e-3
    print(json.dumps({"check": path, "losses_meshtune": want_losses, "losses_torch": losses,
                      "first_loss_rel_diff": first_loss, "max_rel_loss_diff": worst_loss,
                      "max_rel_grad_diff": worst_grad, "ok": ok}))
    return 0 if ok else 1


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=["small", "2b"], default="small")
    p.add_argument("--layers", type=int, default=0, help="0 = the shape's default (small 2, 2b 18)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--check", help="compare against a bench_train --dump file instead of timing")
    o = p.parse_args()
    torch.set_num_threads(o.threads)
    if o.check:
        return check(o.check, o.threads)

    c = config(o.shape, o.layers)
    B, T = o.batch, o.seq_len
    gen = torch.Generator().manual_seed(1234)
    t0 = time.perf_counter()
    with torch.no_grad():
        model = GemmaLora(c, o.rank, gen)
    init_s = time.perf_counter() - t0
    print(f"torch_lora_step: {o.shape} L{c['layers']}: random weights in {init_s:.2f} s", file=sys.stderr)
    tokens = torch.randint(0, c["vocab"], (B, T), generator=gen)
    targets = torch.randint(0, c["vocab"], (B, T), generator=gen)

    cpu_start = cpu_times()
    times, losses = train(model, tokens, targets, o.lr, o.warmup, o.steps)
    cpu_end = cpu_times()
    step = float(np.median(times))
    forward, backward = count_flops(c, B, T, o.rank)
    print(json.dumps({
        "impl": "torch", "shape": o.shape, "layers": c["layers"], "threads": o.threads, "batch": B, "seq_len": T,
        "lora_rank": o.rank, "params": num_parameters(c), "trainable_params": sum(t.numel() for t in model.trainable),
        "steps": o.steps, "warmup": o.warmup, "init_s": init_s, "ms_per_step": 1e3 * step,
        "ms_per_step_min": 1e3 * min(times), "ms_per_step_max": 1e3 * max(times), "tokens_per_s": B * T / step,
        "peak_rss_gib": peak_rss_gib(), "gflop_per_step": (forward + backward) / 1e9, "gflop_forward": forward / 1e9,
        "gflops": (forward + backward) / step / 1e9, "first_loss": losses[0], "last_loss": losses[-1],
        "foreign_cpus": foreign_cpus(cpu_start, cpu_end), "torch_version": torch.__version__,
        "torch_threads": torch.get_num_threads()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
