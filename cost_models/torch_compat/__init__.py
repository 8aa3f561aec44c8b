"""torch runtime shared by the profilers and the executor: torch's private names in one module (torch_private),
torchrun's launcher (elastic), a rank's device and process-group backend (devices), the optimizers zeropipe trains
with (optimizers), and the process's memory as the host sees it (host)."""
