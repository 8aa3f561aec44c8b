"""Measuring: the model profiler, the cluster probe, the runtime overhead probe and NVML topology. The only
cost_models code that runs torch on this machine's devices; its results are records (cost_models.records)."""
