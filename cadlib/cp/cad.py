"""CAD as a CP mechanism: the linear layout stays where the tokens are (contiguous parts of the
sequence), the CAD scheduler (:func:`cadlib.scheduling.scheduler.schedule`) cuts the documents into CA-tasks and
places them on attention servers, and :func:`cadlib.runtime.stages.cad_attention` runs them (all-to-all Q and
deduplicated KV to the servers, one fused call per server, outputs back; exact backward).

CA-tasks are causal, so CAD serves the causal masks (``causal``, ``causal_document``); asking for a
full mask raises ValueError.
"""
from __future__ import annotations

from ..core.cost import MIN_SHARD_TOKENS, as_model
from ..runtime.stages import cad_attention
from ..scheduling.scheduler import schedule
from .protocol import CPMechanism, contiguous_layout


def cad_plan(doc_lens, world: int, model=None, tolerance: float = 0.1, min_shard: int = MIN_SHARD_TOKENS):
    """CAD's plan for the contiguous layout of ``doc_lens`` over ``world`` ranks (what :class:`CADCP` runs)."""
    return schedule(contiguous_layout(doc_lens, world), model=as_model(model), tolerance=tolerance,
                    min_shard=min_shard)


class CADCP(CPMechanism):
    name = "cad"

    def __init__(self, group, doc_lens, causal: bool = True, attn_backend: str | None = None,
                 model=None, tolerance: float = 0.1, min_shard: int = MIN_SHARD_TOKENS):
        if not causal:
            raise ValueError("CAD serves causal masks only (CA-tasks are causal); use causal or "
                             "causal_document")
        super().__init__(group, doc_lens, causal, attn_backend)

        self.plan = cad_plan(self.doc_lens, self.world, model, tolerance, min_shard)
        self.set_layout(self.plan.layout)

    def apply_attn(self, q, k, v):
        self.check_qkv(q, k, v)
        return cad_attention(q, k, v, self.plan, self.group, attn_backend=self.attn_backend, return_lse=True)
