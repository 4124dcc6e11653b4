"""Scheduling (numpy; imports the core and data): the CAD scheduler (its plain reference, its
vectorised engine, equal-FLOPs, the guard), DistCA's planner as a baseline, nano-batches, sent-last
plans, and how a run builds its plans."""
