"""The core (numpy; imports nothing else of cadlib): the linear layout, CA-tasks and plans, the cost
model, runs of rows, a step's spans, the defaults of a run, and every figure quoted from the papers."""
