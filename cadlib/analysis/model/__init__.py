"""The step model: a step composed from per-rank phase durations (``compose``), the cost-model simulator
(``sim``), straggler-idle studies (``idle``) and the simulator's error bands against real steps (``band``)."""
