"""Two ranks call cad_attention with inputs that must be rejected before any all-to-all.

Round 1: rank 0 passes bfloat16, rank 1 float32 (each valid alone: the ranks disagree).
Round 2: every rank passes integer tensors. Each rank records the ValueError messages.

torchrun --standalone --nproc-per-node=2 tests/launch_targets/cad_bad_input.py
"""
import torch

from cadlib.core.layout import Layout
from cadlib.core.plan import CATask, Plan
from cadlib.infra.groups import destroy, init_from_env
from cadlib.infra.progress import write_result
from cadlib.runtime.stages import cad_attention


def main():
    d = init_from_env()
    layout = Layout([[(0, 0, 4)], [(0, 4, 8)]], [8])
    plan = Plan(layout, [CATask(0, 0, 4, 0, 1), CATask(0, 4, 8, 1, 0)])
    dtype = torch.bfloat16 if d.rank == 0 else torch.float32
    errors = []
    for q in (torch.randn(4, 2, 3).to(dtype), torch.ones(4, 2, 3, dtype=torch.int64)):
        try:
            cad_attention(q, q, q, plan, d.group)
            errors.append("no error")
        except ValueError as e:
            errors.append(str(e))
    write_result({"errors": errors})
    destroy()


if __name__ == "__main__":
    main()
