"""The executor service: one process = one node; runs the attempts dispatched to it."""
