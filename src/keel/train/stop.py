"""Stopping a run cleanly: SIGINT (Ctrl-C) and SIGTERM only set a flag, and the training loop acts on it at the
next step boundary, so a signal never lands inside an optimiser step or a checkpoint write."""

from __future__ import annotations

import signal

from keel import runtime


class DeferredStop:
    """Installs the flag-setting handlers (`install`) and puts the previous ones back (`restore`). A signal that
    came before, while Python had swallowed its KeyboardInterrupt (keel.runtime.PENDING_SIGNALS), counts too: the
    run stops at its first boundary."""

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict = {}

    def install(self) -> DeferredStop:
        def request_stop(signum, frame):
            self.signum = signum
        for signum in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[signum] = signal.signal(signum, request_stop)
            except ValueError:  # not the main thread: leave signals alone
                pass
        if runtime.PENDING_SIGNALS:
            self.signum = runtime.PENDING_SIGNALS.pop()
            runtime.PENDING_SIGNALS.clear()
        return self

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def requested(self, world, device) -> bool:
        """Whether any rank was signalled: all ranks stop at the same step, or the others would wait forever."""
        flag = self.signum is not None
        if world.distributed:
            import torch

            t = torch.tensor([float(flag)], device=device)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
            flag = bool(t.item())
        return flag
