"""The runtime (torch; imports the core and dispatch): attention kernels, the all-to-all, the
attention server, CAD's stages, ping-pong, the model and its batches."""
