"""Cost-aware plan generation across all running tasks: pure functions, no I/O."""
