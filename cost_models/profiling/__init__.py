"""Measuring: the model profiler (model_profiler, over units, counting, flops, work_counter, tp_watch, split_backward,
timing, tensors, progress, and moe for mixture-of-experts blocks), the cluster probe (cluster_probe, resolved from
`--cluster` by cluster_source), the runtime overhead probe (overhead_probe) and NVML topology (nvml_topology). The
only cost_models code that runs torch on this machine's devices; its results are records (cost_models.records)."""
