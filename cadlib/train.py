"""End-to-end training steps of a Llama-style decoder under CAD and its baselines (a torchrun entry).

    torchrun --standalone --nproc-per-node 2 -m cadlib.train --methods colocated,cad,cad-pingpong \\
        --model tiny --tokens-per-rank 1024 --steps 5
    # from a notebook: cadlib.infra.launch.run_torchrun("cadlib.train", 2, [...])

Methods (every one sees the same sampled batches, from the same initial weights):

* ``colocated``: sequential packing (DistCA's), each rank attends its own chunks; the KV prefix of a
  document split across ranks is all-gathered from the ranks that hold it (per-document CP).
* ``wlb``: WLB-LLM variable-length ``balanced`` packing + the same per-document CP ("WLB-ideal").
* ``cad``: sequential packing, core attention on the scheduler's attention servers, no overlap.
* ``cad-pingpong``: two nano-batches per rank, each with its own plan, in DistCA's tick order
  (``--nano-split docs``, the default: a document may be cut between them, :mod:`cadlib.scheduling.nanosplit`,
  so that a rank holding one long document still has two halves to overlap; ``whole``: whole
  documents in each).
* ``signal-only``: ``cad-pingpong`` with every all-to-all cut to one element per peer (the control
  that shows what communication still costs).

``--pp N`` (and ``--microbatches``): the same methods under pipeline parallelism over a DP x PP grid,
colocated and wlb in 1F1B, the CAD methods in DistCA's lock-step ticks (:mod:`cadlib.train_pp`). One
loop (:func:`main`) runs both: only the step's schedule differs (:class:`Runner` without stages,
:class:`cadlib.train_pp.PipelineRunner` with them).

``--sent-last`` (off by default): ``cad``, ``cad-pingpong`` and ``signal-only`` lay each rank's tokens
(of each nano-batch) out with the rows its plan sends to other servers last, so that the servers
read their buffers in place (:mod:`cadlib.scheduling.sentlast`); the same tasks, losses and gradients.

A step: forward and backward of all ranks' tokens (loss = sum of token cross-entropies / the number
of predicted tokens of the whole batch, so every method computes the same loss and gradient), the
data-parallel gradient all-reduce, AdamW. Per step and rank a record holds the step time and where it
went (linear, attention, communication and how much of it was exposed, the all-reduce wait, the LM
head), peak memory and the loss; the spans of the last step (``--timeline``: of every step), and those
of the batches ``--timeline-batches`` names. Warm-up steps run the first batches and are not recorded.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from .core.methods import METHODS as ALL_METHODS
from .core.recompute import least_recompute
from .core.spans import overlap
from .cp.allgather import layout_attention
from .data.packing import pack
from .infra.groups import allreduce_grads, comm_group, destroy, init_from_env, make_grid
from .infra.progress import log, report_progress, write_result
from .runtime.batches import positions, synthetic_tokens
from .runtime.comm import AllToAll, SignalOnly
from .runtime.fused import HAVE_TRITON
from .runtime.kernels import TORCH_DTYPES
from .runtime.model import ChunkedCrossEntropy, Decoder
from .runtime.pingpong import pingpong_layers
from .runtime.stages import cad_attention, prepare
from .runtime.streams import Streams, Timeline, spanned
from .scheduling import scheduler
from .scheduling.recipes import (batch_docs, cad_plan, method_layout,
                                 nano_plans)
from .train_args import parse_args
from .train_pp import PipelineRunner, check_config

"""What ``--methods`` takes (:mod:`cadlib.core.methods`)."""


# ------------------------------------------------------------------- a step without pipeline stages
def _colocated_attention(layout, group, attn_backend, tl):
    """Per-document CP on ``layout``: the all-gather mechanism of :mod:`cadlib.cp` (the kernel calls
    alone are the timeline's attention spans; the whole call, all-gathers and waits included, is a
    ``cp`` span)."""
    return lambda q, k, v: layout_attention(q, k, v, layout, group, attn_backend=attn_backend, timeline=tl)


class Step:
    """Everything one (method, batch) needs on this rank, built on the host before the step."""

    def __init__(self, method, docs, args, rank, world, group, device):
        self.method = method
        m = ALL_METHODS[method]
        self.layout = method_layout(docs, world, args.recipe, m, model=args.model, cap=args.wlb_cap)
        spec, recipe = args.spec, args.recipe
        self.n_valid = sum(n - 1 for n in docs)
        self.context = None
        one_plan = m.cad and not m.pingpong
        if m.pingpong:
            self.nanos, self.plans = nano_plans(self.layout, recipe, spec)
        else:
            self.plans = [cad_plan(self.layout, recipe, spec)] if one_plan else []
        # the tokens in the layout's order (cad with --sent-last: its plan's re-ordered layout)
        tokens_layout = self.plans[0].layout if one_plan else self.layout
        tok, tgt = synthetic_tokens(tokens_layout, rank, spec.vocab, args.seed)
        pos = positions(tokens_layout, rank)
        if m.pingpong:
            self.inputs = [tuple(t[torch.as_tensor(nb.rows[rank])].to(device) for t in (tok, tgt, pos))
                           for nb in self.nanos]
            ctx = self.nanos[1].context
            if ctx and len(ctx[rank]):            # B's KV-only rows of A's local buffer on this rank
                self.context = torch.as_tensor(ctx[rank]).to(device)
        else:
            self.inputs = [tuple(t.to(device) for t in (tok, tgt, pos))]
        self.dds = [prepare(p, group, device) for p in self.plans]
        # per plan: rows this rank sends away, and its server's gathered (query, KV) rows
        self.server_rows = [[d.meta.n_send_q, *d.meta.gathered_rows()] for d in self.dds]
        self.imbalance = [p.imbalance() for p in self.plans] or \
            [scheduler.colocated(self.layout).imbalance()]


def forward(step: Step, model, group, streams, tl, args):
    """Forward of this rank's tokens; returns the local sum of token cross-entropies."""
    m = ALL_METHODS[step.method]
    comm = SignalOnly(group) if m.signal_only else AllToAll(group)

    def head(h, tgt):
        # the chunked LM-head loss, called directly: Decoder.loss also counts targets on the host
        return spanned(tl, "head", lambda x: ChunkedCrossEntropy.apply(x, model.lm_head.weight, tgt,
                                                                        args.ce_chunk), h)

    if m.pingpong:
        (ta, ya, pa), (tb, yb, pb) = step.inputs
        xs = [model.embed(ta), model.embed(tb)]
        ropes = [model.rope(pa), model.rope(pb)]
        xa, xb = pingpong_layers(model, xs, ropes, step.dds, comm, streams, args.attn_backend, tl,
                                 context=step.context)
        return head(model.norm(xa), ya) + head(model.norm(xb), yb)
    tok, tgt, pos = step.inputs[0]
    if m.cad:
        plan = step.plans[0]

        def attn(q, k, v, i):
            return cad_attention(q, k, v, plan, group, args.attn_backend, comm, streams, tl)
    elif args.colocated_impl == "allgather":
        fn = _colocated_attention(step.layout, group, args.attn_backend, tl)

        def attn(q, k, v, i):
            return spanned(tl, "cp", fn, q, k, v)
    else:
        plan = scheduler.colocated(step.layout)

        def attn(q, k, v, i):
            return spanned(tl, "attn", lambda a, b, c: cad_attention(a, b, c, plan, group,
                                                                      args.attn_backend), q, k, v)
    return head(model(tok, pos, attn), tgt)


class Runner:
    """The step's schedule without pipeline stages: every rank runs the whole model over its tokens,
    forward, then backward (:class:`cadlib.train_pp.PipelineRunner` is the schedule with stages; the
    loop of :func:`main` runs either)."""

    def __init__(self, model, args, env, grid, cad_group):
        self.model, self.args, self.env, self.cad_group = model, args, env, cad_group
        self.streams = Streams(env.device)

    def step(self, method: str, b: int) -> Step:
        e = self.env
        return Step(method, batch_docs(self.args.recipe, b, e.world), self.args, e.rank, e.world,
                    self.cad_group, e.device)

    def run(self, step: Step, tl: Timeline) -> torch.Tensor:
        """Forward and backward of this rank's tokens; returns its summed cross-entropy."""
        # CAD's all-to-alls on their group; per-document CP over the world's
        group = self.cad_group if ALL_METHODS[step.method].cad else self.env.group
        with tl.span("step", "forward"):
            loss = forward(step, self.model, group, self.streams, tl, self.args)
        with tl.span("step", "backward"):
            (loss / step.n_valid).backward()
        return loss

    def record(self, step: Step, loss: float, rows: list[dict]) -> dict:
        return {"loss": loss, "tokens": sum(int(t[0].numel()) for t in step.inputs),
                "plan_imbalance": step.imbalance, "n_docs": step.layout.n_docs,
                "sent_gathered_rows": step.server_rows, **step_metrics(rows)}

    @staticmethod
    def detail(rec: dict) -> str:
        return (f"attn {rec['attention_ms']:.1f}, comm {rec['comm_ms']:.1f} exposed "
                f"{rec['comm_exposed_ms']:.1f}, all-reduce {rec['allreduce_ms']:.1f}")


# --------------------------------------------------------------------------------------- metrics
def step_metrics(rows: list[dict]) -> dict:
    """Milliseconds per category from one step's spans (see the module docstring)."""
    def spans(pred):
        return [(r["start_ms"], r["end_ms"]) for r in rows if pred(r)]

    def total(pred):
        return float(sum(b - a for a, b in spans(pred)))

    phase = {r["phase"]: r for r in rows if r["lane"] == "step"}
    fwd_bwd = phase["backward"]["end_ms"] - phase["forward"]["start_ms"]
    attn = total(lambda r: r["lane"] == "compute" and r["phase"].startswith("attn"))
    head = total(lambda r: r["lane"] == "compute" and r["phase"].startswith("head"))
    ov = overlap(rows)
    comm_ms = ov["comm_ms"]
    exposed = comm_ms - ov["overlapped_ms"]
    return {"step_ms": phase["optimizer"]["end_ms"] - phase["forward"]["start_ms"],
            "fwd_bwd_ms": fwd_bwd, "layers_ms": fwd_bwd - head, "attention_ms": attn, "head_ms": head,
            "comm_ms": comm_ms, "comm_exposed_ms": exposed,
            "linear_ms": fwd_bwd - attn - head - exposed,
            "allreduce_ms": phase["allreduce"]["end_ms"] - phase["allreduce"]["start_ms"],
            "optimizer_ms": phase["optimizer"]["end_ms"] - phase["optimizer"]["start_ms"]}


# ------------------------------------------------------------------------------------------- main
def timeline_batches(args, world: int) -> set[int]:
    """The batches whose spans ``--timeline-batches`` keeps; ``auto``: the two whose colocated attention
    is the most imbalanced (the stragglers worth looking at)."""
    tb = args.timeline_batches
    if tb == "none":
        return set()
    if tb != "auto":
        return {int(x) for x in tb.split(",")}
    imb = {b: scheduler.colocated(pack(batch_docs(args.recipe, b, world), world, args.tokens_per_rank,
                                       method="sequential", model=args.model)).imbalance()
           for b in range(args.steps)}
    return set(sorted(imb, key=lambda b: -imb[b])[:2])


def keep_timeline(timelines: dict, method: str, rows, args, i: int) -> None:
    """``--timeline``: every recorded step's spans; else the last step's."""
    if args.timeline:
        timelines.setdefault(method, []).append(rows)
    elif i == args.warmup + args.steps - 1:
        timelines[method] = rows


def write_run(env, args, model, records, timelines, **extra) -> None:
    """This rank's result file (records, timelines, the configuration, the model), then tear down."""
    cuda = env.device.type == "cuda"
    write_result({"rank": env.rank, "world": env.world, "device": str(env.device), "group_rank": env.node,
                  "local_rank": env.local_rank, "local_world": env.local_world,
                  "device_name": torch.cuda.get_device_name(env.device) if cuda else "cpu",
                  "torch": torch.__version__, "records": records, "timelines": timelines, **extra,
                  "config": {k: v for k, v in vars(args).items() if k not in ("spec", "recipe")},
                  "model": {"name": args.spec.name, "layers": args.spec.n_layers,
                            "stage_layers": list(model.layer_ids),
                            "params": sum(p.numel() for p in model.parameters())}})
    destroy()


def layer_settings(args, device, world: int) -> None:
    """How the layers compute, into ``args`` (so the result's config records it): ``linear_blocks``, the
    fused kernels on a GPU with triton, else the plain references (``Decoder(blocks="auto")``); and for
    ``--recompute auto`` the least recompute the memory model fits in this GPU's memory
    (:func:`cadlib.core.recompute.least_recompute`; none on the CPU), its peaks in ``recompute_auto``."""
    cuda = device.type == "cuda"
    args.linear_blocks = "fused" if cuda and HAVE_TRITON else "reference"
    if args.recompute == "auto":
        cap = torch.cuda.get_device_properties(device).total_memory if cuda else None
        args.recompute_auto = least_recompute(args.spec, args.methods, args.tokens_per_rank, world, cap,
                                              pp=args.pp, n_micro=args.microbatches, ce_chunk=args.ce_chunk,
                                              fused=args.linear_blocks == "fused")
        args.recompute = args.recompute_auto["recompute"]
    args.mlp_recompute = args.recompute == "mlp"


def start_step(tl: Timeline, env) -> None:
    """Every rank starts a timed step together: the device idle and its peak-memory counter reset, a
    barrier, then the timeline's origin."""
    if env.device.type == "cuda":
        torch.cuda.synchronize(env.device)
        torch.cuda.reset_peak_memory_stats(env.device)
    dist.barrier(group=env.group)
    tl.origin()


def total_loss(loss_sum: torch.Tensor, group) -> torch.Tensor:
    """The batch's summed cross-entropy on every rank (under pipeline stages the last stage holds it;
    the others add zero)."""
    out = loss_sum.detach().clone()
    dist.all_reduce(out, group=group)
    return out


def dump_grads(args, model, method: str, grid) -> None:
    """``--dump-grads``: the first step's gradients by their name in the whole model, saved by the
    first data-parallel rank (of each stage: ``<method>.stage<s>.pt`` under pipeline stages)."""
    os.makedirs(args.dump_grads, exist_ok=True)
    name = f"{method}.stage{grid.stage}.pt" if args.pipeline else f"{method}.pt"
    torch.save({model.global_name(n): p.grad.detach().float().cpu() for n, p in model.named_parameters()},
               os.path.join(args.dump_grads, name))


def main(argv=None) -> int:
    """Every method's steps: the same batches from the same weights. A step is the schedule's forward
    and backward (:class:`Runner`, or :class:`cadlib.train_pp.PipelineRunner` with ``--pp`` /
    ``--microbatches``), the data-parallel gradient all-reduce and AdamW."""
    args = parse_args(argv)
    dp = None
    if args.pipeline:                   # checked on every rank before the first collective
        dp = check_config(args.spec.n_layers, int(os.environ.get("WORLD_SIZE", "1")), args.pp,
                          args.microbatches, args.dp, args.sent_last)
    env = init_from_env(args.pg_backend)
    grid = make_grid(env, args.pp, dp)                   # one stage: the world is the data-parallel group
    cad_group = comm_group(env.group, args.comm_ctas)   # CAD's all-to-alls; per-document CP keeps env.group
    torch.manual_seed(args.seed)
    layer_settings(args, env.device, env.world)
    model = Decoder(args.spec, dtype=TORCH_DTYPES[args.dtype], device=env.device, recompute=args.recompute,
                    seed=args.seed, stage=(grid.stage, grid.pp))
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    runner = (PipelineRunner if args.pipeline else Runner)(model, args, env, grid, cad_group)
    cuda = env.device.type == "cuda"
    records, timelines, by_batch = [], {}, {}
    keep = set() if args.pipeline else timeline_batches(args, env.world)
    n_total, done = len(args.methods) * (args.warmup + args.steps), 0
    for method in args.methods:
        model.load_state_dict(init)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        tl = Timeline(env.device)
        for i in range(args.warmup + args.steps):
            b = i - args.warmup if i >= args.warmup else i      # warm-up reuses the first batches
            step = runner.step(method, b)                      # host work: documents, plans, inputs
            start_step(tl, env)
            loss_sum = runner.run(step, tl)
            with tl.span("step", "allreduce"):
                allreduce_grads(model.parameters(), grid.dp_group)
            if args.dump_grads and i == 0 and grid.dp_rank == 0:
                dump_grads(args, model, method, grid)
            with tl.span("step", "optimizer"):
                opt.step()
                opt.zero_grad(set_to_none=True)
            rows = tl.rows()                               # one device sync, after the step
            loss = float(total_loss(loss_sum, env.group)) / step.n_valid
            done += 1
            report_progress(done, n_total, f"{method} step {i + 1}")
            if i < args.warmup:
                continue
            rec = {"method": method, "batch": b, "rank": env.rank, **runner.record(step, loss, rows),
                   "peak_mem_gib": torch.cuda.max_memory_allocated(env.device) / 2**30 if cuda else None}
            records.append(rec)
            keep_timeline(timelines, method, rows, args, i)
            if b in keep:
                by_batch.setdefault(method, {})[str(b)] = rows
            if env.rank == 0:
                log(f"{method:>12} batch {b}: loss {loss:.5f} step {rec['step_ms']:.1f} ms "
                    f"({runner.detail(rec)})")
    grid_fields = {"grid": {"dp": grid.dp, "pp": grid.pp, "stage": grid.stage, "dp_rank": grid.dp_rank}}
    write_run(env, args, model, records, timelines, timelines_batches=by_batch,
              **(grid_fields if args.pipeline else {}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
