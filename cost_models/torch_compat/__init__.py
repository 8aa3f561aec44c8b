"""torch runtime shared by the profilers and the executor: torch's private names in one module, torchrun's
launcher, the optimizers zeropipe trains with, and the process's memory as the host sees it."""
