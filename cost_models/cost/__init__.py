"""Pure cost functions over records: step time, memory and communication of a strategy (estimate, compute,
kernels, comm, memory, sharing; moe for expert parallelism, context_parallel for context parallelism, lengths for
a profile seen at another sequence length) and the schedule simulator. Nothing here imports torch or a probe
(tests check)."""
