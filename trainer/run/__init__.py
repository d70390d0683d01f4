"""The run around the step: preflight, start-up, the Run, loop, optimizer, checkpoints, resume, metrics, profiling."""
