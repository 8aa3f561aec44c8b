"""Pure cost functions over records: step time, memory and communication of a strategy (estimate, compute,
kernels, comm, memory, sharing) and the schedule simulator. Nothing here imports torch or a probe (tests check)."""
