"""hivepipe: the node (CLI, volunteer worker, swarm launcher) and the shared floor (model, protocol)."""
