"""Training steps under pipeline parallelism (``python -m cadlib.train --pp N``): DP x PP ranks, a step
of ``--microbatches`` microbatches through ``N`` stages of the decoder.

The grid is ``torch.arange(world).view(pp, dp)`` (:func:`cadlib.infra.groups.make_grid`): global rank
``s * dp + d`` is data-parallel rank ``d`` of stage ``s``. A microbatch is ``dp`` ranks'
``--tokens-per-rank`` tokens (its own documents, packed over the stage's data-parallel ranks); stage
``s`` holds layers ``[s L/N, (s+1) L/N)``, the first stage the embedding, the last the final norm,
LM head and loss. The loss is the batch's summed token cross-entropy over its predicted tokens, as
without PP, so the gradients are the same.

* ``colocated`` / ``wlb``: Megatron's 1F1B (:func:`cadlib.core.pipeline.one_f_one_b`); each stage
  attends its own microbatch's chunks, documents split across its data-parallel ranks through
  per-document CP over the stage's data-parallel group (as without PP). Plain autograd per microbatch.
* ``cad`` / ``cad-pingpong`` / ``signal-only``: DistCA's lock-step ticks
  (:func:`cadlib.core.pipeline.lockstep`): all stages run the same phase, and in every tick the
  CA-tasks of all stages' current microbatches are scheduled together over all GPUs
  (:mod:`cadlib.scheduling.pipeline`), so a stage in warm-up or drain, with nothing of its own to
  run, still serves attention (a dummy). Servers are stateless and each stage runs its layers'
  backward itself (:mod:`cadlib.runtime.pipeline`); ping-pong inside a tick.

Activations and their gradients go between stages by batched ``isend``/``irecv`` at the schedule's
boundaries. A step's spans add a ``tick`` lane (one span per tick: its phase and microbatch) and a
``p2p`` lane; each record adds, per tick, the query rows this rank's server attended for each stage.
"""
from __future__ import annotations

import torch

from .core.layout import Layout
from .core.methods import METHODS
from .core.pipeline import lockstep, one_f_one_b, p2p_1f1b, p2p_lockstep
from .core.spans import overlap, union
from .cp.allgather import layout_attention
from .infra.groups import Grid, check_grid
from .runtime.batches import positions, synthetic_tokens
from .runtime.comm import AllToAll, SignalOnly
from .runtime.kernels import resolve_backend
from .runtime.model import ChunkedCrossEntropy
from .runtime.pipeline import CadStage, p2p
from .runtime.stages import cad_attention, prepare
from .runtime.streams import Streams, Timeline
from .scheduling import scheduler
from .scheduling.pipeline import micro_nanos, tick_plans
from .scheduling.recipes import method_layout, micro_docs, micro_seed


def check_config(n_layers: int, world: int, pp: int, n_micro: int, dp: int | None = None,
                 sent_last: bool = False) -> int:
    """Validate a pipeline run on every rank before any collective; returns the data-parallel
    degree. ValueError naming the parameter: ``--pp`` must divide the layers and the world size,
    ``--dp x --pp`` must be the world size, ``--microbatches`` must be >= 1 (any count works: the
    schedules turn missing microbatches into bubbles or dummies), and ``--sent-last`` is not
    supported with more than one stage."""
    for name, v in (("--pp", pp), ("--microbatches", n_micro)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    if n_layers % pp:
        raise ValueError(f"--pp {pp} must divide the model's {n_layers} layers (--layers), so that every "
                         f"stage holds as many")
    try:
        dp = check_grid(world, pp, dp)
    except ValueError as e:
        raise ValueError(f"--pp/--dp: {e}") from None
    if sent_last and pp > 1:
        raise ValueError("--sent-last is not supported with --pp > 1 (each tick has its own plan)")
    return dp


def micro_layouts(args, method: str, b: int, n_micro: int, dp: int) -> list[Layout]:
    """The microbatches of batch ``b``, each laid over ``dp`` ranks as the method lays a batch
    (:func:`cadlib.scheduling.recipes.method_layout`: ``wlb`` balanced, DistCA's ping and pong, ...)."""
    return [method_layout(micro_docs(args.recipe, b, m, n_micro, dp), dp, args.recipe, METHODS[method],
                          model=args.model, cap=args.wlb_cap) for m in range(n_micro)]


class PipelineStep:
    """One (method, batch) on this rank: microbatches, their inputs here, the schedule and (CAD) the
    tick plans, built on the host before the step."""

    def __init__(self, method, args, b, grid: Grid, world_group, device, hidden: int):
        self.method, self.grid, self.n_micro, self.hidden = method, grid, args.microbatches, hidden
        self.layouts = micro_layouts(args, method, b, self.n_micro, grid.dp)
        self.n_valid = sum(n - 1 for lay in self.layouts for n in lay.doc_lens)
        self.lockstep = METHODS[method].cad             # CAD's methods: lock-step ticks
        d, spec = grid.dp_rank, args.spec
        self.nanos = micro_nanos(self.layouts, args.recipe) if METHODS[method].pingpong else None
        self.inputs, self.context = [], []
        for m, lay in enumerate(self.layouts):
            tok, tgt = synthetic_tokens(lay, d, spec.vocab, micro_seed(args.recipe, b, m))
            pos = positions(lay, d)
            if self.nanos is None:
                self.inputs.append([tuple(t.to(device) for t in (tok, tgt, pos))])
                self.context.append(None)
            else:
                self.inputs.append([tuple(t[torch.as_tensor(nb.rows[d])].to(device) for t in (tok, tgt, pos))
                                    for nb in self.nanos[m]])
                ctx = self.nanos[m][1].context
                self.context.append(torch.as_tensor(ctx[d]).to(device) if ctx and len(ctx[d]) else None)
        if self.lockstep:
            self.ticks = lockstep(grid.pp, self.n_micro)
            self.batches = p2p_lockstep(self.ticks)[grid.stage]
            self.plans = tick_plans(self.ticks, self.layouts, args.recipe, spec, self.nanos)
            self.dds = [[prepare(p, world_group, device) for p in ps] for ps in self.plans]
            rank = grid.rank_of(grid.stage)
            self.imbalance = [[p.imbalance() for p in ps] for ps in self.plans]
            self.served = [[_served_by_stage(p, rank, grid) for p in ps] for ps in self.plans]
        else:
            orders = one_f_one_b(grid.pp, self.n_micro)
            self.ops, self.batches = orders[grid.stage], p2p_1f1b(orders)[grid.stage]
            self.imbalance = [scheduler.colocated(lay).imbalance() for lay in self.layouts]
            self.served = None

    def rows(self, m: int) -> list[int]:
        """This rank's rows of microbatch ``m``, per nano-batch."""
        return [int(t[0].numel()) for t in self.inputs[m]]


def _served_by_stage(plan, rank: int, grid: Grid) -> list[int]:
    """Query rows the server on ``rank`` attends in ``plan``, per home stage."""
    q, _ = plan.token_matrices()
    return [int(q[grid.ranks[s], rank].sum()) for s in range(grid.pp)]


class PipelineRunner:
    """The step's schedule with pipeline stages: runs :class:`PipelineStep` s on this rank's stage
    (``model``: its :class:`~cadlib.runtime.model.Decoder` stage) inside the training loop of
    :func:`cadlib.train.main`, as :class:`cadlib.train.Runner` does without stages."""

    def __init__(self, model, args, env, grid: Grid, cad_group):
        self.model, self.args, self.grid, self.device = model, args, grid, env.device
        self.cad_group = cad_group
        self.streams = Streams(env.device)
        spec = args.spec
        self.heads = (spec.n_heads, spec.n_kv_heads, spec.head_dim)
        self.backend = resolve_backend(args.attn_backend, env.device, model.dtype, spec.head_dim)

    def step(self, method: str, b: int) -> PipelineStep:
        return PipelineStep(method, self.args, b, self.grid, self.cad_group, self.device,
                            self.args.spec.hidden)

    def record(self, step: PipelineStep, loss: float, rows: list[dict]) -> dict:
        g = self.grid
        return {"stage": g.stage, "dp_rank": g.dp_rank, "loss": loss,
                "tokens": sum(sum(step.rows(m)) for m in range(step.n_micro)),
                "plan_imbalance": step.imbalance, "n_docs": sum(lay.n_docs for lay in step.layouts),
                "served_rows_by_stage": step.served,
                "schedule": ([[t.phase, t.micro[g.stage]] for t in step.ticks] if step.lockstep
                             else [[o.kind, o.micro] for o in step.ops]),
                **pp_metrics(rows)}

    @staticmethod
    def detail(rec: dict) -> str:
        return (f"pipeline {rec['pipeline_ms']:.1f}, attn {rec['attention_ms']:.1f}, busy "
                f"{rec['busy_fraction']:.0%}")

    # -- the exchanges between stages ---------------------------------------------------------------
    def _exchange(self, step: PipelineStep, batch, tl: Timeline) -> None:
        sends, recvs, keys = [], [], []
        g = self.grid
        for msg in batch:
            peer = g.rank_of(msg.dst if msg.src == g.stage else msg.src)
            key = (msg.kind, msg.micro)
            if msg.src == g.stage:
                sends += [(t, peer) for t in self.outbox.pop(key)]
            else:
                likes = [torch.empty((n, self.hidden), dtype=self.model.dtype, device=self.device)
                         for n in step.rows(msg.micro)]
                recvs += [(like, peer) for like in likes]
                keys.append((key, len(likes)))
        if not sends and not recvs:
            return
        with tl.span("p2p", "p2p"):
            got = iter(p2p(sends, recvs, g.pp_group))
        for key, n in keys:
            self.inbox[key] = [next(got) for _ in range(n)]

    def _head(self, hs, step: PipelineStep, m: int):
        """The last stage's loss of microbatch ``m``: summed cross-entropy / the batch's predicted tokens."""
        total = 0.0
        for h, (_, tgt, _) in zip(hs, step.inputs[m]):
            with self.tl.span("compute", "head"):
                total = total + ChunkedCrossEntropy.apply(self.model.norm(h), self.model.lm_head.weight,
                                                          tgt, self.args.ce_chunk)
        self.loss_sum = self.loss_sum + total.detach()
        return total / step.n_valid

    # -- a step -------------------------------------------------------------------------------------
    def run(self, step: PipelineStep, tl: Timeline) -> torch.Tensor:
        """Forward and backward of every microbatch (one ``pipeline`` span); returns this rank's summed
        cross-entropy (the last stage's; zero elsewhere). Parameter gradients accumulate in ``.grad``."""
        with tl.span("step", "pipeline"):
            return self._schedule(step, tl)

    def _schedule(self, step: PipelineStep, tl: Timeline) -> torch.Tensor:
        self.tl, self.hidden = tl, step.hidden
        self.inbox, self.outbox, self.keep = {}, {}, {}
        self.loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        if step.lockstep:
            signal_only = METHODS[step.method].signal_only
            comm = (SignalOnly if signal_only else AllToAll)(self.cad_group)
            self.stage = CadStage(self.model.layers, comm, self.streams, self.backend, self.heads,
                                  self.model.dtype, self.device, tl)
            for t, tick in enumerate(step.ticks):
                m = tick.micro[self.grid.stage]
                with tl.span("tick", f"{tick.phase}{'-' if m is None else m} t{t}"):
                    self._exchange(step, step.batches[t], tl)
                    (self._cad_forward if tick.phase == "F" else self._cad_backward)(step, t, m)
        else:
            for k, op in enumerate(step.ops):
                with tl.span("tick", f"{op.kind}{op.micro} t{k}"):
                    self._exchange(step, step.batches[k], tl)
                    (self._colocated_forward if op.kind == "F" else self._colocated_backward)(step, op.micro)
            self._exchange(step, step.batches[-1], tl)
        assert not self.keep and not self.inbox and not self.outbox, "the schedule left work behind"
        return self.loss_sum

    # -- colocated 1F1B -----------------------------------------------------------------------------
    def _colocated_forward(self, step, m):
        md, first, last = self.model, self.model.first, self.model.last
        tok, tgt, pos = step.inputs[m][0]
        cos, sin = md.rope(pos)
        x = md.embed(tok) if first else self.inbox.pop(("act", m))[0].requires_grad_()
        layout, args, tl = step.layouts[m], self.args, self.tl
        if args.colocated_impl == "allgather":       # the kernel calls are the timeline's attention spans
            def attn(q, k, v, i):
                return layout_attention(q, k, v, layout, self.grid.dp_group, self.backend, timeline=tl)
        else:
            plan = scheduler.colocated(layout)

            def attn(q, k, v, i):
                return cad_attention(q, k, v, plan, self.grid.dp_group, self.backend, tl=tl)
        with tl.span("compute", "stage"):
            h = md.run_layers(x, cos, sin, attn)
        if last:
            self.keep[m] = (x, self._head([h], step, m))
        else:
            self.outbox[("act", m)] = [h.detach()]
            self.keep[m] = (x, h)

    def _colocated_backward(self, step, m):
        x, y = self.keep.pop(m)
        with self.tl.span("compute", "stage'"):
            torch.autograd.backward(y, None if self.model.last else self.inbox.pop(("grad", m))[0])
        if not self.model.first:
            self.outbox[("grad", m)] = [x.grad]

    # -- CAD's lock-step ticks ----------------------------------------------------------------------
    def _cad_forward(self, step, t, m):
        md, dds = self.model, step.dds[t]
        n_nano = len(dds)
        if m is None:                                    # a dummy: serve the others' attention
            z = torch.zeros((0, self.hidden), dtype=md.dtype, device=self.device)
            rope = md.rope(torch.zeros(0, dtype=torch.int64, device=self.device))
            self.stage.forward([z] * n_nano, [rope] * n_nano, dds, grad=False)
            return
        ins = step.inputs[m]
        ropes = [md.rope(pos) for _, _, pos in ins]
        embeds = [md.embed(tok) for tok, _, _ in ins] if md.first else None
        xs = embeds if md.first else self.inbox.pop(("act", m))
        outs, saved = self.stage.forward(xs, ropes, dds, step.context[m])
        if md.last:
            hs = [o.requires_grad_() for o in outs]
            self.keep[m] = (embeds, saved, hs, self._head(hs, step, m))
        else:
            self.outbox[("act", m)] = outs
            self.keep[m] = (embeds, saved, None, None)

    def _cad_backward(self, step, t, m):
        dds = step.dds[t]
        if m is None:
            self.stage.backward(None, None, dds, len(dds))
            return
        embeds, saved, hs, loss = self.keep.pop(m)
        if self.model.last:
            with self.tl.span("compute", "head'"):
                loss.backward()
            grads = [h.grad for h in hs]
        else:
            grads = self.inbox.pop(("grad", m))
        g_in = self.stage.backward(saved, grads, dds, len(dds), step.context[m])
        if self.model.first:
            torch.autograd.backward(embeds, g_in)
        else:
            self.outbox[("grad", m)] = g_in


def pp_metrics(rows: list[dict]) -> dict:
    """Milliseconds per category from one pipeline step's spans: the step, the schedule, attention
    (kernel spans), communication and its exposed part, point to point, the all-reduce, the
    optimizer, and the busy share of the schedule (compute or exposed communication)."""
    def total(pred):
        return float(sum(r["end_ms"] - r["start_ms"] for r in rows if pred(r)))

    phase = {r["phase"]: r for r in rows if r["lane"] == "step"}
    sched = phase["pipeline"]["end_ms"] - phase["pipeline"]["start_ms"]
    ov = overlap(rows)
    attn = total(lambda r: r["lane"] == "compute" and r["phase"].startswith("attn"))
    compute = sum(b - a for a, b in union([(r["start_ms"], r["end_ms"]) for r in rows
                                           if r["lane"] == "compute"]))
    exposed = ov["comm_ms"] - ov["overlapped_ms"]
    return {"step_ms": phase["optimizer"]["end_ms"] - phase["pipeline"]["start_ms"], "pipeline_ms": sched,
            "attention_ms": attn, "comm_ms": ov["comm_ms"], "comm_exposed_ms": exposed,
            "p2p_ms": total(lambda r: r["lane"] == "p2p"),
            "allreduce_ms": phase["allreduce"]["end_ms"] - phase["allreduce"]["start_ms"],
            "optimizer_ms": phase["optimizer"]["end_ms"] - phase["optimizer"]["start_ms"],
            "busy_fraction": min(1.0, (compute + exposed) / sched) if sched > 0 else float("nan"),
            "n_ticks": sum(1 for r in rows if r["lane"] == "tick")}
