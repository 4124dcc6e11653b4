"""The benchmarks' toolkit: one timer (``timer``: CUDA events on a GPU, the wall clock on the CPU, after a
warm-up), random inputs of a serve stage's sizes (``inputs``), memory peaks, TF/s, versions (``meters``)."""
