"""Scale: processes (torch.distributed), FSDP2 / activation checkpointing / compile, and the memory model."""
