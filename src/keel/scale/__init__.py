"""Scale: processes (torch.distributed), the one builder (junction, AC, compile, pipeline, FSDP2), memory.

The values of the run fields this package reads live here, so that keel.config validates a config
without importing torch (parallel) or torch.distributed.pipelining (pipeline)."""

from keel.errors import ConfigError

# run.pp_schedule -> (torch.distributed.pipelining class, stages per rank, stage placement). Interleaved schedules
# place stage s on rank s % pp; ZBV places two stages per rank in a V. keel.scale.pipeline keeps the ones this
# PyTorch has.
PP_SCHEDULE_SPECS = {
    "1f1b": ("Schedule1F1B", 1, "loop"),
    "gpipe": ("ScheduleGPipe", 1, "loop"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", 2, "loop"),
    "interleaved_zb": ("ScheduleInterleavedZeroBubble", 2, "loop"),
    "zbv": ("ScheduleZBVZeroBubble", 2, "v"),
}
PP_SCHEDULES = tuple(PP_SCHEDULE_SPECS)  # run.pp_schedule's values
# run.fused_junction's values and default (keel.scale.fused_junction.apply_fused_junction); the kernel module (and
# triton) is imported only when a junction is fused
FUSED_JUNCTION = ("auto", "on", "composed", "off")  # composed: fused by the compiler across blocks (run.compile)
FUSED_JUNCTION_DEFAULT = "auto"


def check_pipeline(model, run) -> None:
    """Why `run` (a RunConfig) cannot be pipelined with `model` (a ModelConfig), as a ConfigError; nothing if it
    can. Needs no torch; keel.scale.pipeline.check_config adds whether this PyTorch has the schedule."""
    if run.pp == 1:
        return
    if model.loop_blocks is not None:
        raise ConfigError("run.pp: a looped model (model.loop_blocks) shares blocks between passes, which stages "
                          "cannot split; allowed: run.pp=1, or model.loop_blocks=null")
    if model.tie_embeddings:
        raise ConfigError("run.pp: tied embeddings would put one matrix on the first and the last stage; allowed: "
                          "run.pp=1, or model.tie_embeddings=false")
    per_rank = PP_SCHEDULE_SPECS[run.pp_schedule][1]
    if model.n_blocks < run.pp * per_rank:
        raise ConfigError(f"run.pp: {run.pp * per_rank} stages ({run.pp_schedule}, {per_rank} per rank) "
                          f"need at least as many blocks, model.n_blocks={model.n_blocks}")
    if run.batch_size % run.pp_microbatches:
        raise ConfigError(f"run.pp_microbatches: {run.pp_microbatches} does not divide run.batch_size="
                          f"{run.batch_size}; allowed: a divisor of run.batch_size")
