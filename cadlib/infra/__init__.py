"""Infrastructure (imports nothing else of cadlib): result files and their provenance, progress and
results of launched ranks, process groups, launching torchrun, stopping process trees."""
