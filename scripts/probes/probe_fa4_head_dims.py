"""Which head dims FlashAttention-4 gets right, forward and backward, against ``sdpa_ref`` (fp32).

    python scripts/probes/probe_fa4_head_dims.py            # on a GPU with flash-attn-4 (and torch_flash)

Two causal segments of 20 and 41 tokens, bf16, per (query heads, KV heads, head_dim); prints the
relative max error of o, dq, dk, dv for fa4 and torch_flash. What it found on an H200 (FA4 4.0.0b36,
results/fa4_head_dims_h200.txt) is why ``cadlib.runtime.kernels.FA4_HEAD_DIMS`` exists."""
import sys
import time

import torch

from cadlib.runtime.kernels import attend, attend_backward

CASES = [(8, 2, 8), (8, 8, 8), (8, 2, 64), (16, 8, 128), (8, 2, 128)]


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA device with flash-attn-4", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    dev = "cuda"
    cu = torch.tensor([0, 20, 61], dtype=torch.int32, device=dev)
    for hq, hkv, d in CASES:
        t0 = time.time()
        q, do = (torch.randn(61, hq, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
        k, v = (torch.randn(61, hkv, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
        res = {}
        for b in ("fa4", "torch_flash", "sdpa_ref"):
            try:
                qq, kk, vv, dd = (t.float() if b == "sdpa_ref" else t for t in (q, k, v, do))
                o, lse = attend(qq, kk, vv, cu, cu, 41, 41, causal=True, backend=b)
                g = attend_backward(dd, qq, kk, vv, o, lse, cu, cu, 41, 41, causal=True, backend=b)
                res[b] = [o.float(), *[x.float() for x in g]]
            except Exception as e:       # a backend missing or refusing the head dim: say so
                res[b] = repr(e)[:160]
        for b in ("fa4", "torch_flash"):
            if isinstance(res[b], str):
                print(f"hq {hq} hkv {hkv} d {d:3d} {b:11s} not run: {res[b]}")
                continue
            errs = [float((x - r).abs().max() / r.abs().max()) for x, r in zip(res[b], res["sdpa_ref"])]
            print(f"hq {hq} hkv {hkv} d {d:3d} {b:11s} o {errs[0]:.1e} dq {errs[1]:.1e} dk {errs[2]:.1e} "
                  f"dv {errs[3]:.1e}  ({time.time() - t0:.0f}s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
