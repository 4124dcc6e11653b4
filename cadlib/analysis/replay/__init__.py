"""The scale replay: the paper's settings and each rank's work (``settings``), what is timed on one GPU
(``times``), phase durations composed into steps (``phases``), results and checks (``results``), 4D (``pipelined``)."""
