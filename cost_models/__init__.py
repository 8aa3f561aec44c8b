"""Measurements and pure cost functions: the bottom layer of zeropipe (nothing here imports planner/executor)."""
