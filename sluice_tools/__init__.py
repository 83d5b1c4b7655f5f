"""The top floor: the CLI, the local stack, the simulator, benchmarks and the demo. Nothing below imports it."""
