"""Scale: processes (torch.distributed), the one builder (junction, AC, compile, pipeline, FSDP2), memory."""
