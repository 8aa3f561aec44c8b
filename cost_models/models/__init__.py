"""What a model is to zeropipe: the model families it knows (families: how each is recognised, its tensor-parallel
dimensions, a transformers family's pipeline layout), the built-in zoo (zoo, gpt, llama, mlp, moe: mixtures of
experts, chain), the resolution of `--model` references (source: zoo name, module:factory, hf:config), the
training loss an input implies (losses), whether a torch model can be cut into pipeline stages (pipelining) and
which tensor-parallel plan fits it (tp_shape), and the tokens' places in their sequence under context parallelism
(positions).

Every zoo model is a chain of pipeline units: `embed` -> `blocks[0..L-1]` -> `head`, each a module that takes one
tensor and returns one tensor, so that the same module names serve the profiler, the planner's stage partition and
the executor's stage construction (as torchtitan's pipeline split does with module names).
"""
