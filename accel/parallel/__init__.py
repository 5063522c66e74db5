"""Context parallelism: mesh, attention functions, SDPA routing and the plan engine."""
