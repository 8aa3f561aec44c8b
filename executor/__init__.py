"""Runs plans with real torch.distributed code (the top layer: imports planner and cost_models, never the reverse)."""
