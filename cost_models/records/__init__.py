"""Plain data every layer reads, and the rules over it: no torch, no cost functions.

File records and their I/O (base, file_record, fileio), the two input files a user hands the planner (files), the
model and cluster profiles (profile, cluster) and their checks (validate), the alpha-beta fit a collective record
carries (fit), errors, limits, formatting, the training strategy and what its precision costs in bytes (strategy,
precision), a pass's work by kind (work), the pipeline schedule IR with its registry and generators (schedule), cluster presets (presets), the
best published utilisation per GPU class (published) and tensor-parallel plans as data (tensor_parallel).
"""
