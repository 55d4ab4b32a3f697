"""The engine: the only package that joins host and device. It compiles the step for each bucket,
launches it, moves plans and outputs, and runs the loop."""
