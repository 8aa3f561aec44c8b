"""Strategy search and partitioning over cost_models' predictions (imports cost_models only)."""
