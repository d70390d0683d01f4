"""The run around the step: preflight, start-up, the loop, optimizer, checkpoints, resume, metrics, profiling."""
