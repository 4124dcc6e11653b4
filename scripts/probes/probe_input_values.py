"""Does an attention server run faster on the zeros the signal-only control receives than on real values?

The signal-only control (``cadlib.runtime.stages.SignalOnly``) cuts every all-to-all to one element per peer;
the receiver used to get zeros of the expected size. A GPU's tensor cores draw less power on zeros and
the clock stays higher, so a server whose rows are largely received would run its attention faster in
the control than with real data, and (CAD step - control step) would count that speed-up as exposed
communication. This probe times the same fused varlen attention (forward, and forward + backward) and a
bf16 GEMM of the model's MLP size on:

* ``random``: normal values (what real activations look like to the hardware);
* ``zeros``: all zeros (what the control received before);
* ``half_zeros``: the first half of the rows zeros (a server whose rows are half received);
* ``copied``: random rows copied in another order (what the control receives now: the sender's own rows).

Kinds are interleaved round by round, each round ``--calls`` back-to-back calls (sustained load, as in a
training step), so clock and thermal drift hit every kind alike.

    python scripts/probes/probe_input_values.py --out $OUT/input_values_probe_h200.json     # 1x H200
    python scripts/probes/probe_input_values.py --device cpu --out /tmp/p.json --rounds 1   # harness only
"""
from __future__ import annotations

import argparse
import statistics

import torch

from cadlib.bench.timer import time_samples
from cadlib.infra.results import save_result
from cadlib.runtime import kernels

KINDS = ("random", "zeros", "half_zeros", "copied")


def fill(kind: str, like: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A tensor shaped like ``like`` whose values are of ``kind`` (see the module docstring)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    x = torch.randn(like.shape, generator=gen, device=like.device).to(like.dtype)
    if kind == "zeros":
        x.zero_()
    elif kind == "half_zeros":
        x[: x.shape[0] // 2].zero_()
    elif kind == "copied":
        perm = torch.randperm(x.shape[0], generator=gen, device=like.device)
        x = x[perm].contiguous()
    return x


def time_calls(fn, device, calls: int) -> float:
    """Milliseconds per call over ``calls`` back-to-back calls, queued behind a device sleep (device
    time: one pair of marks around the batch)."""
    def batch():
        for _ in range(calls):
            fn()
    return time_samples(batch, device, iters=1, warmup=0, ahead=True)[0] / calls


def workloads(device, dtype, tokens: int, heads, d: int, hidden: int, ffn: int, backend: str | None):
    """name -> (builder(kind, gen) -> zero-argument callable)."""
    hq, hkv = heads
    n = tokens
    cu = torch.tensor([0, n], dtype=torch.int32, device=device)
    like_q = torch.empty(n, hq, d, device=device, dtype=dtype)
    like_kv = torch.empty(n, hkv, d, device=device, dtype=dtype)

    def attn_fwd(kind, gen):
        q, k, v = fill(kind, like_q, gen), fill(kind, like_kv, gen), fill(kind, like_kv, gen)
        return lambda: kernels.attend(q, k, v, cu, cu, n, n, backend=backend)

    def attn_fwd_bwd(kind, gen):
        q, k, v = fill(kind, like_q, gen), fill(kind, like_kv, gen), fill(kind, like_kv, gen)
        do = fill(kind, like_q, gen)

        def run():
            out, lse = kernels.attend(q, k, v, cu, cu, n, n, backend=backend)
            kernels.attend_backward(do, q, k, v, out, lse, cu, cu, n, n, backend=backend)
        return run

    like_x = torch.empty(n, hidden, device=device, dtype=dtype)
    like_w = torch.empty(ffn, hidden, device=device, dtype=dtype)

    def gemm(kind, gen):
        x, w = fill(kind, like_x, gen), fill(kind, like_w, gen)
        return lambda: x @ w.t()

    return {"attention_fwd": attn_fwd, "attention_fwd_bwd": attn_fwd_bwd, "mlp_gemm": gemm}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=None, help="one causal document (default 32768 on GPU)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=None, help="back-to-back calls per timing (default: ~1 s)")
    ap.add_argument("--backend", default=None, help="attention backend (default: the best available)")
    args = ap.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    dtype = torch.bfloat16 if cuda else torch.float32
    tokens = args.tokens or (32768 if cuda else 256)
    heads, d = ((64, 8), 128) if cuda else ((4, 2), 16)
    hidden, ffn = (4096, 14336) if cuda else (64, 224)
    backend = kernels.resolve_backend(args.backend, device, dtype, d)
    gen = torch.Generator(device=device).manual_seed(0)
    built = {(w, kind): make(kind, gen)
             for w, make in workloads(device, dtype, tokens, heads, d, hidden, ffn, backend).items()
             for kind in KINDS}
    calls = {}
    for (w, kind), fn in built.items():                # warm up, and size each timing to ~1 s
        fn()
        if kind == KINDS[0]:
            one = time_calls(fn, device, 3)
            calls[w] = args.calls or max(3, int(1000 / max(one, 1e-3)))
    times: dict[tuple[str, str], list[float]] = {key: [] for key in built}
    for r in range(args.rounds):
        order = KINDS if r % 2 == 0 else KINDS[::-1]
        for w in calls:
            for kind in order:
                times[(w, kind)].append(time_calls(built[(w, kind)], device, calls[w]))
        print(f"round {r + 1}/{args.rounds}", flush=True)
    rows = []
    for w in calls:
        base = statistics.median(times[(w, "random")])
        for kind in KINDS:
            ms = statistics.median(times[(w, kind)])
            rows.append({"workload": w, "kind": kind, "ms": ms, "vs_random": ms / base,
                         "ms_all": times[(w, kind)], "calls": calls[w]})
            print(f"{w:>18} {kind:>10}: {ms:8.3f} ms  ({ms / base:.3f}x random)", flush=True)
    save_result(args.out, {"device": str(device), "dtype": str(dtype), "tokens": tokens, "heads": heads,
                           "head_dim": d, "hidden": hidden, "ffn": ffn, "backend": backend,
                           "rounds": args.rounds}, rows)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
