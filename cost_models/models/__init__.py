"""Built-in model zoo and the resolution of `--model` references (zoo name, module:factory, hf:config).

Every zoo model is a chain of pipeline units: `embed` -> `blocks[0..L-1]` -> `head`, each a module that takes one
tensor and returns one tensor, so that the same module names serve the profiler, the planner's stage partition and
the executor's stage construction (as torchtitan's pipeline split does with module names).
"""
