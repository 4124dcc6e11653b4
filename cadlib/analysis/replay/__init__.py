"""The scale replay: the paper's settings and each rank's work (``settings``), what is timed on one GPU
(``times``), phase durations composed into steps (``phases``), results and checks (``results``), the
paper's protocol and our variants (``protocol``); with PP, the settings (``settings4d``), their
composition (``pipelined``) and the protocol's memory-filtered sweep (``sweep4d``)."""
