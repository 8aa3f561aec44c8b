"""Plain data every layer reads, and the rules over it: no torch, no cost functions.

File records and their I/O (base, file_record, fileio), the model and cluster profiles (profile, cluster), their
checks (validate), errors, limits, formatting, the training strategy (strategy, precision), the pipeline schedule
IR with its registry and generators (schedule), cluster presets and tensor-parallel plans as data.
"""
