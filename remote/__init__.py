"""The far side of process boundaries: nodes, podman, and programs that run elsewhere."""
