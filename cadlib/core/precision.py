"""Floating-point formats by name, defined once: the bytes of an element, torch's name for each format
a run computes in, and the relative error a result in each may show against a high-precision
reference. The runtime turns the names into torch dtypes (:data:`cadlib.runtime.kernels.TORCH_DTYPES`).
"""
from __future__ import annotations

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}
"""Bytes per element (``fp8`` only sizes transfers; nothing here computes in it)."""

TORCH_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""The formats runs compute in, and their torch names."""

DTYPES = tuple(TORCH_NAMES)
"""``fp32``, ``bf16``, ``fp16``: what the attention checks (``cadlib.verify``, ``cadlib.cp.check``) and
the kernel benchmarks take."""

TRAIN_DTYPES = ("fp32", "bf16")
"""What ``python -m cadlib.train`` takes: it scales no loss, so no fp16."""

RTOL = {"fp32": 1e-5, "bf16": 2e-2, "fp16": 5e-3}
"""Default max relative error ``max |got - ref| / max |ref|`` of attention outputs and gradients
against the reference (fp32 per-document attention, or float64), per input format."""
