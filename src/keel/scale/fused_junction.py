"""Keel's junction computed in one piece, installed from outside the model by swapping modules
(docs/internals.md#keelscalefused_junction)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Collection

import torch
from torch import nn

from keel.errors import ConfigError
from keel.kernels.norm_pair import rms_norm_pair
from keel.model.layers import RMSNorm
from keel.model.numerics import upcast
from keel.model.transformer import Residual
from keel.scale import FUSED_JUNCTION_DEFAULT


class FusedResidual(Residual):
    """A `Residual` at a fused junction, swapped in by `apply_fused_junction`: the same alpha, norm modules and
    equation, with the junction between two sub-layers computed in one piece (docs/internals.md#fusedresidual)."""

    junction: Callable[[torch.Tensor, torch.Tensor], torch.Tensor | tuple[torch.Tensor, torch.Tensor]] | None = None
    hands_head = False  # the stack's last sub-layer, whose u goes unused (apply_fused_junction): not a junction
    incoming: NormPair | None = None  # previous norm_out, own norm_in: when the previous one handed on its sum

    def forward(self, x: torch.Tensor | tuple[torch.Tensor, torch.Tensor], branch: Callable[..., torch.Tensor],
                *args) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if isinstance(x, tuple):
            x, u = x
        else:
            x = upcast(x)
            if self.incoming is not None:  # x is the previous sub-layer's alpha*x + h: its norm_out, here
                x, u = self.incoming(x)
            else:
                u = x if self.norm_in is None else self.norm_in(x)
        h = self.update(u, branch, *args)
        if self.junction is not None:
            return self.junction(x, h)
        y = self.alpha * x + h.to(x.dtype)
        return y if self.norm_out is None else self.norm_out(y)

    def _apply(self, fn, recurse=True):
        # the stack's last sub-layer holds an unregistered copy of a norm (apply_fused_junction): it follows the
        # model's moves and casts (.to, .double, ...) as the registered ones do
        super()._apply(fn, recurse)
        if self.hands_head and hasattr(self.junction, "next_norm_in"):
            self.junction.next_norm_in._apply(fn, recurse)
        return self

    def extra_repr(self) -> str:
        return super().extra_repr() + (", fused junction" if self.junction is not None else "")


class StreamOfPair(nn.Identity):
    """A looped model's final norm (an identity: the stack ends in a norm_out) where the `FusedResidual` that ends
    the stack also hands the next pass a pair: it hands the head the stream."""

    def forward(self, x: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return x[0] if isinstance(x, tuple) else x


class FusedJunction:
    """`FusedResidual.junction` with the Triton kernel: `(x, h) -> (norm_out(alpha*x + h), next_norm_in(...))`."""

    def __init__(self, alpha: float, norm_out: RMSNorm, next_norm_in: RMSNorm):
        from keel.kernels.junction import keel_junction  # noqa: PLC0415 (triton: only when fusing)

        # the norm modules, not their weights: each weight is read at call time, as FSDP2 swaps the sharded and the
        # gathered parameter in and out
        self.alpha, self.norm_out, self.next_norm_in, self.op = alpha, norm_out, next_norm_in, keel_junction
        self.norms = (norm_out, next_norm_in)  # what it applies (`handed_norms`)

    def __call__(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w_in, device = self.next_norm_in.weight, x.device.type
        # the dtype the next branch computes in (keel.model.layers.compute_dtype): autocast's where it is on
        u_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else w_in.dtype
        return self.op(x, h, self.alpha, self.norm_out.weight, w_in, self.norm_out.eps, impl="triton",
                       u_dtype=u_dtype)


class NormPair:
    """`z -> (norm_out(z), next_norm_in(norm_out(z)))` for the compiler to fuse: RMSNorms as one op of
    keel.kernels.norm_pair (`one_pass`), else the two modules in turn; a plain object (docs/internals.md#normpair)."""

    def __init__(self, norm_out: nn.Module, next_norm_in: nn.Module, one_pass: bool = True):
        self.norm_out, self.next_norm_in = norm_out, next_norm_in
        self.norms = (norm_out, next_norm_in)  # what it applies (`handed_norms`)
        self.one_pass = one_pass and isinstance(norm_out, RMSNorm) and isinstance(next_norm_in, RMSNorm)

    def __call__(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.one_pass:  # forward, not __call__: see `IncomingNorm`
            y = self.norm_out.forward(z)
            return y, self.next_norm_in.forward(y)
        w_in, device = self.next_norm_in.weight, z.device.type
        # the dtype the next branch computes in (keel.model.layers.compute_dtype): autocast's where it is on
        u_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else w_in.dtype
        return rms_norm_pair(z, self.norm_out.weight, w_in, self.norm_out.eps, self.next_norm_in.eps,
                             None if u_dtype == z.dtype else u_dtype)


class ComposedJunction:
    """`FusedResidual.junction` for a compiled model where the Triton kernel cannot run: a `NormPair` of the modules
    themselves, inside the compiled block that ends with `norm_out` (docs/internals.md#composedjunction)."""

    def __init__(self, alpha: float, norm_out: nn.Module, next_norm_in: nn.Module, one_pass: bool = True):
        self.alpha, self.next_norm_in = alpha, next_norm_in
        self.pair = NormPair(norm_out, next_norm_in, one_pass)
        self.norms = self.pair.norms

    def __call__(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pair(self.alpha * x + h.to(x.dtype))


class SumHandoff:
    """`FusedResidual.junction` between two compiled blocks: `(x, h) -> alpha*x + h`, normalised by the next block."""

    norms = ()  # it applies none: the next block does (`handed_norms`)

    def __init__(self, alpha: float):
        self.alpha = alpha

    def __call__(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return self.alpha * x + h.to(x.dtype)


class IncomingNorm:
    """`NormOfSum`'s norm: the stack's last `norm_out`, applied to the sum it handed on. A plain object, not an
    nn.Module, so that norm is not registered twice and state dicts stay as they were.

    It runs the norm's `forward`, not the module call, as `NormPair` does: a norm applied outside its own block is,
    under FSDP2, in a unit that the root gathers for the whole step (keel.scale.parallel.apply_fsdp), and a module
    call would fire that unit's own hooks, which free the gathered gains once the first of them has its gradient,
    while the other blocks' backwards still read theirs."""

    def __init__(self, norm: nn.Module):
        self.norm = norm
        self.norms = (norm,)

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        return self.norm.forward(z)


class NormOfSum(nn.Identity):
    """The final norm (an identity: the stack ends in a norm_out) where the stack's last sub-layer hands on its
    sum (`SumHandoff`): that sub-layer's `norm_out`, held unregistered (the state dict keeps no key for it)."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.__dict__["incoming"] = IncomingNorm(norm)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.incoming(z)


def junctions(model: nn.Module, across_blocks: bool = True,
              stage_starts: Collection[int] = ()) -> list[tuple[Residual, Residual]]:
    """Every pair of consecutive sub-layers where the first has a norm_out and the second a norm_in (Keel's
    junctions); `across_blocks=False`: only pairs in one block; `stage_starts`: blocks no pair crosses into."""
    subs = model.sublayers()
    successors: dict[str, set[str]] = {}
    for a, b in zip(subs, [*subs[1:], None]):
        if b is None:
            successors.setdefault(a.path, set())
            if not isinstance(model.final_norm, nn.Identity):  # a final norm that would have to take the pair
                successors[a.path].add("")
        elif a.norm_out and b.norm_in and (a.block == b.block or across_blocks and b.block not in stage_starts):
            successors.setdefault(a.path, set()).add(b.path)
        else:
            successors.setdefault(a.path, set()).add("")  # a successor that takes no fused input
    return [(model.get_submodule(a), model.get_submodule(next(iter(b))))
            for a, b in successors.items() if len(b) == 1 and "" not in b]


def apply_fused_junction(model: nn.Module, mode: str = FUSED_JUNCTION_DEFAULT, across_blocks: bool = True,
                         compiled: bool = False, checkpointed: bool = False, stage_starts: Collection[int] = (),
                         one_pass: bool = True) -> int:
    """Fuse every junction (`junctions`) as `mode` (one of FUSED_JUNCTION) asks; returns how many. Call before AC,
    compile and FSDP, on the model's final device (docs/internals.md#apply_fused_junction)."""
    _swap(model, _unfused)
    pairs = junctions(model, across_blocks, stage_starts)
    if mode == "off" or not pairs or (mode == "auto" and not compiled and next(model.parameters()).device.type
                                        != "cuda"):  # nothing to fuse: an eager model off CUDA (no triton import)
        return 0
    from keel.kernels.junction import can_fuse  # noqa: PLC0415 (triton: only when there is something to fuse)

    device, width = next(model.parameters()).device, model.config.d_model
    problem = None
    if not can_fuse(device, width):
        problem = f"the Triton kernel cannot run on {device} at width {width} (needs triton and CUDA)"
    elif not all(isinstance(n, RMSNorm) for a, b in pairs for n in (a.norm_out, b.norm_in)):
        problem = "the kernel computes RMSNorm only (model.norm=rmsnorm)"
    elif len({n.eps for a, b in pairs for n in (a.norm_out, b.norm_in)}) > 1:
        problem = "the kernel takes one eps for both norms"
    impl = junction_impl(mode, device.type, compiled, problem)
    if impl is None:
        return 0
    # a compiled block hands on its sum (`SumHandoff`); under AC the kernel fuses inside blocks only
    inside = set(junctions(model, across_blocks=False))
    handoff = impl == "composed" and model.config.loop_blocks is None
    if checkpointed and not handoff:
        pairs = [p for p in pairs if p in inside]
    across = [p for p in pairs if p not in inside] if handoff else []
    def op(alpha: float, norm_out: nn.Module, next_norm_in: nn.Module):
        if impl == "kernel":
            return FusedJunction(alpha, norm_out, next_norm_in)
        return ComposedJunction(alpha, norm_out, next_norm_in, one_pass)
    ops = {a: op(a.alpha, a.norm_out, b.norm_in) for a, b in pairs if (a, b) not in across}
    ops |= {a: SumHandoff(a.alpha) for a, _ in across}
    incoming = {b: NormPair(a.norm_out, b.norm_in, one_pass) for a, b in across}
    takers = {b for _, b in pairs}
    last = model.get_submodule(model.sublayers()[-1].path)
    ends_stack = last in ops  # a looped model (see `junctions`)
    # Compiled with junctions across blocks, every block takes a sum (or with the kernel a pair (stream, u)) and
    # hands one on, except the last, which hands the head a stream: a block layout of its own, one more graph to
    # compile (seconds each, cold). Handing on sums, the last sub-layer hands its sum too, and the final norm applies
    # its norm_out (`NormOfSum`). With pairs, its last sub-layer computes a junction too, with a copy of its own
    # norm_in as the "next" norm, and the
    # head takes the stream of the pair: the last block compiles to the middle blocks' graph. The copy is held by
    # the junction (a plain object), not registered: parameters and state dicts are unchanged (FusedResidual._apply
    # moves and casts it with the model). u, unused, costs one norm forward and backward per step (the copy's
    # weight must require grad like the others, or the graph differs) and gives the model's parameters no gradient.
    tail = (compiled and across_blocks and (handoff or not checkpointed) and not ends_stack and last in takers
            and last.norm_out is not None and isinstance(model.final_norm, nn.Identity))
    if tail:
        ops[last] = SumHandoff(last.alpha) if handoff else op(last.alpha, last.norm_out, copy.deepcopy(last.norm_in))
        ends_stack = True

    def fused(m: nn.Module) -> nn.Module | None:
        if m not in ops and m not in takers:
            return None
        new = _rebuilt(m, FusedResidual)
        new.junction, new.incoming = ops.get(m), incoming.get(m)
        new.hands_head = tail and m is last
        return new
    _swap(model, fused)
    if ends_stack:
        model.final_norm = NormOfSum(last.norm_out) if tail and handoff else StreamOfPair()
    return len(pairs)


def handed_norms(module: nn.Module) -> list[nn.Module]:
    """The norms of `module` (a model, or a pipeline stage) that a junction applies outside the block holding them,
    which FSDP2 must keep gathered (docs/internals.md#keelscalefused_junctionhanded_norms)."""
    blocks = module.blocks.values() if isinstance(module.blocks, nn.ModuleDict) else module.blocks
    registered = set(module.modules())  # not the unregistered copy the stack's last pair may hold
    handed: dict[int, nn.Module] = {}
    for block in blocks:
        own = set(block.modules())
        for m in block.modules():  # in order: every rank must list the same norms in the same order
            if isinstance(m, FusedResidual):
                applied = [*getattr(m.junction, "norms", ()), *(m.incoming.norms if m.incoming else ())]
                handed |= {id(n): n for n in applied if n not in own and n in registered}
    final = getattr(module, "final_norm", None)
    if isinstance(final, NormOfSum):
        handed[id(final.incoming.norm)] = final.incoming.norm
    return list(handed.values())


def _unfused(m: nn.Module) -> nn.Module | None:
    if isinstance(m, FusedResidual):
        return _rebuilt(m, Residual)
    return nn.Identity() if isinstance(m, (StreamOfPair, NormOfSum)) else None


def _rebuilt(res: Residual, cls: type[Residual]) -> Residual:
    """A `cls` holding `res`'s alpha and its very submodules (norms, dropout): the same parameters under the same
    names. Hooks registered on `res` stay behind."""
    new = cls.__new__(cls)
    nn.Module.__init__(new)
    for key in ("_parameters", "_buffers", "_non_persistent_buffers_set", "_modules"):
        new.__dict__[key] = copy.copy(res.__dict__[key])
    # alpha, training, and the absent norms (None attributes, not registered modules)
    skip = ("junction", "hands_head", "incoming")  # FusedResidual's own, set by apply_fused_junction
    new.__dict__.update((k, v) for k, v in vars(res).items() if not k.startswith("_") and k not in skip)
    return new


def _swap(model: nn.Module, replacement: Callable[[nn.Module], nn.Module | None]) -> None:
    """Put `replacement(child)` in place of every child of every module of `model` for which it returns one.
    Walks the modules as registered (inside AC's wrappers too), not by `sublayers()` paths."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            new = replacement(child)
            if new is not None:
                setattr(parent, name, new)


def hands_on_sums(run, config, device: torch.device, kernel_available: bool | None = None) -> bool:
    """Whether `run` (a RunConfig) compiles `config`'s model with the junctions left to the compiler, so that its
    blocks hand on sums (`SumHandoff`); `kernel_available`: triton and CUDA there (None: look here; see
    docs/internals.md#hands_on_sums)."""
    if not run.compile or run.fused_junction == "off":
        return False
    from keel.kernels.junction import MAX_FUSED_WIDTH, can_fuse  # noqa: PLC0415 (triton: only where fused)

    if kernel_available is None:
        kernel_available = can_fuse(device, config.d_model)
    runs = kernel_available and config.norm == "rmsnorm" and 0 < config.d_model <= MAX_FUSED_WIDTH
    problem = None if runs else "the kernel cannot run here"
    return junction_impl(run.fused_junction, device.type, True, problem) == "composed"


def junction_impl(mode: str, device_type: str, compiled: bool, problem: str | None) -> str | None:
    """How a junction is fused: "kernel", "composed" (by the compiler) or None; `problem`: why the kernel cannot run
    here. "on" with neither raises a ConfigError (docs/internals.md#junction_impl)."""
    if mode == "off":
        return None
    if mode == "composed":
        if not compiled:
            raise ConfigError("run.fused_junction=composed: the compiler fuses the junction, so it needs "
                              "run.compile=true; allowed without it: auto, on or off")
        return "composed"
    if problem is None and (mode == "on" or (device_type == "cuda" and not compiled)):
        return "kernel"
    if compiled:  # "auto", or "on" where the kernel cannot run: the compiler's fusion
        return "composed"
    if mode == "on":
        raise ConfigError(f"run.fused_junction=on: {problem} and run.compile is off (with run.compile=true "
                          "the compiler fuses it); allowed here: auto or off")
    return None


def fused_junctions(model: nn.Module) -> int:
    """How many sub-layers of `model` compute their junction fused."""
    return sum(isinstance(m, FusedResidual) and m.junction is not None and not m.hands_head for m in model.modules())
