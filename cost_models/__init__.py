"""The bottom floor of zeropipe: what a model and a cluster are, how they are measured, and what a strategy costs.

Subpackages, lowest first (each imports only those before it; nothing here imports planner or executor):
  records/       plain data every layer reads: file records and their I/O, errors, limits, formatting, the
                 strategy, the schedule IR and its generators, cluster presets, tensor-parallel plans as data
  cost/          pure cost functions over those records: estimate, compute, comm, memory, the schedule simulator
  torch_compat/  torch runtime shared with the executor: torch's private names, the torchrun launcher, optimizers,
                 the process's memory
  models/        what a model family is: the zoo, `--model` references, per family its TP plan and pipeline layout
  profiling/     measuring a model and a cluster: the only code here that runs torch on this machine's devices
"""
