"""Scale: processes (torch.distributed), the one builder (junction, AC, compile, pipeline, FSDP2), memory.

The values of the run fields this package reads live here, so that keel.train.config validates a config
without importing torch (parallel) or torch.distributed.pipelining (pipeline)."""

# run.pp_schedule's values (keel.scale.pipeline maps each to its torch.distributed.pipelining schedule)
PP_SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b", "interleaved_zb", "zbv")
# run.fused_junction's values and default (keel.scale.parallel.apply_fused_junction); the kernel module (and
# triton) is imported only when a junction is fused
FUSED_JUNCTION = ("auto", "on", "off")
FUSED_JUNCTION_DEFAULT = "auto"
