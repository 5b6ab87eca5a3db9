"""Time per step of one plan, from a model's profile and hardware, and the Estimate that
holds it beside the memory per rank (planner/memory.py).

Time per step: the rank's FLOPs (forward, backward = 2 forwards, recomputation = one more)
at the hardware's achieved matmul rate; tensor parallel's all-reduces (on the critical
path); context parallel's K/V gathers and expert parallel's all-to-alls (each MoE layer
sends its (token, expert) pairs' hidden states out and back, forward and backward: on the
critical path); the pipeline's bubble ((pp - 1) micro-batch times, halved by
interleaving); data parallel's gradient reduction (the experts' over the ranks ep leaves) and FSDP's gathers minus what hides behind computation
(all but the last bucket / block when the computation is longer); the optimizer step
(memory-bound). Collectives cost 2(n-1)/n (all-reduce) or (n-1)/n (gather, scatter) of
their bytes over the group's bandwidth, inside a node or across (mesh order pp, dp, fsdp,
tp: tp ranks are neighbours).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from meshfit.errors import MeshfitError
from meshfit.plan import Plan
from meshfit.planner.hardware import Hardware
from meshfit.planner.memory import (
    _AUTOCAST,
    GRADIENT_BYTES,
    USABLE_MEMORY,
    MemoryEstimate,
    _activation_scale,
    _block_flops,
    _compute_bytes,
    _kv_bytes,
    _optimizer_bytes,
    _rank_memory,
    _shards,
    _split,
    _tp_of,
    build_bytes,
    optimizer_stepping,
    stage_layout,
    step_temporaries,
)
from meshfit.planner.profile import ModelProfile, PartCost

DDP_BUCKET_BYTES = 25 * 1024**2  # DDP's default bucket: the last one cannot hide
PCIE_BANDWIDTH = 25e9  # host <-> device per GPU (PCIe 4/5 x16, usable): offload's transfers
HOST_MEMORY_BANDWIDTH = 10e9  # per process: offload's optimizer step runs on the CPU


@dataclass
class TimeEstimate:
    """Seconds of one training step on the slowest rank."""

    compute: float = 0.0
    communication: float = 0.0  # exposed: what does not hide behind computation
    bubble: float = 0.0
    optimizer: float = 0.0

    @property
    def total(self) -> float:
        return self.compute + self.communication + self.bubble + self.optimizer

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self) | {"total": self.total}


@dataclass
class Estimate:
    """What `plan` costs: memory of its fullest rank, time of a step, throughput."""

    plan: Plan
    batch_size: int
    memory: MemoryEstimate
    ranks: list[MemoryEstimate]
    step_time: TimeEstimate | None = None
    tokens_per_s: float | None = None
    samples_per_s: float | None = None
    flops_per_device: float | None = None  # achieved FLOP/s per device (recomputation counted)
    mfu: float | None = None  # model FLOPs (3 x forward) / (time x devices x peak)
    fits: bool | None = None
    device_memory: float | None = None
    # bytes the fullest rank holds while the engine is built: its parameter share and
    # the largest parameter (built on meta), or the whole model (built on the device)
    build: float = 0.0
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        text = f"{self.plan}: {_gib(self.memory.total)} per rank"
        if self.step_time is not None:
            text += f", {self.step_time.total * 1e3:.1f} ms a step"
            if self.tokens_per_s is not None:
                text += f", {self.tokens_per_s:,.0f} tokens/s"
        return text + "".join(f" ({note})" for note in self.notes)


def estimate_profile(
    profile: ModelProfile,
    plan: Plan,
    *,
    batch_size: int,
    hardware: Hardware | None = None,
    optimizer: str | float = "adamw",
    compiled: bool = False,
    chunked_loss: bool | int = False,
) -> Estimate:
    """The Estimate of `plan` (dp resolved) for a global batch of `batch_size`;
    `compiled`, `chunked_loss`: the run uses parallelize(..., compile=True, chunked_loss=)."""
    if plan.dp is None:
        if hardware is None:
            raise MeshfitError("give the plan's dp, or hardware to resolve dp=auto from")
        plan = plan.resolve(hardware.world_size)
    state_bytes = _optimizer_bytes(optimizer)
    m = plan.num_microbatches
    per_rank = batch_size / plan.data_parallel_size
    mb = per_rank / m
    layout = stage_layout(profile, plan)
    traced = compiled and profile.compiled_autocast == (plan.precision in _AUTOCAST)
    temporaries = _step_temporaries(optimizer, hardware)
    ranks = [
        _rank_memory(
            profile,
            plan,
            blocks,
            first,
            last,
            r,
            mb,
            state_bytes,
            traced,
            chunked_loss,
            temporaries,
        )
        for r, (blocks, first, last) in enumerate(layout)
    ]
    fullest = max(ranks, key=lambda e: e.total)
    result = Estimate(plan=plan, batch_size=batch_size, memory=fullest, ranks=ranks)
    if compiled and not traced:
        if profile.compiled_error:
            why = profile.compiled_error
        elif profile.compiled_autocast is None:
            why = "a ModelProfile is not traced: pass the model to count compiled memory"
        else:
            why = "the profile was traced for another precision"
        result.notes.append(f"compiled memory counted as eager ({why})")
    if plan.ep > 1 and plan.tp > 1 and traced:
        result.notes.append(
            "ep beside tp, compiled: the compiled partition's experts' activations are "
            "counted as tp splits them, where each tp rank keeps them whole (an under-count)"
        )
    result.build = build_bytes(profile, ranks, plan.tp)
    if hardware is not None:
        result.device_memory = hardware.device_memory
        usable = hardware.device_memory * USABLE_MEMORY
        result.fits = fullest.total <= usable and result.build <= usable
        if fullest.total <= usable < result.build:
            if not profile.built_on_meta:
                why = "each rank holds the whole model before the plan splits it; build it on meta"
            elif plan.tp > 1:
                why = (
                    "tensor parallel traces its split on a twin of the model with one block, "
                    "whole; a plan with less tp and more fsdp builds in less"
                )
            else:
                why = "a rank's part and the largest parameter beside it"
            result.notes.append(f"the build does not fit ({_gib(result.build)}): {why}")
        _add_time(result, profile, plan, layout, mb, hardware, state_bytes, compiled)
    return result


def _step_temporaries(optimizer: str | float, hardware: Hardware | None) -> tuple[float, float]:
    """(temporaries the size of the rank's largest parameter, the size of all its
    parameters) the optimizer's step makes: by how it steps (memory.py's tables). A bare
    "adamw" is meshfit's own (fused on a GPU); another bare name steps as torch's
    default does (a list at a time on a GPU); on the CPU both one parameter at a time.
    An optimizer given as its state bytes: none counted."""
    if not isinstance(optimizer, str):
        return 0, 0
    name, stepping = optimizer_stepping(optimizer)
    on_gpu = hardware is not None and hardware.separate_host_memory
    default = ("fused" if name == "adamw" else "foreach") if on_gpu else "for-loop"
    return step_temporaries(name, stepping or default)


def _group(plan: Plan, dim: str) -> tuple[int, int]:
    """(span, stride) of `dim`'s groups in the mesh (the Topology's MESH_ORDER)."""
    from meshfit.topology import MESH_ORDER

    degrees = plan.degrees
    inner = MESH_ORDER[MESH_ORDER.index(dim) + 1 :]
    stride = 1
    for name in inner:
        stride *= degrees[name] or 1
    return stride * (degrees[dim] or 1), stride


def _ep_collective(hw: Hardware, plan: Plan, nbytes: float) -> float:
    """An all-to-all of `nbytes` per rank over the ep group: neighbouring loss ranks
    (topology.py), tp ranks apart; each rank keeps 1/ep of its bytes."""
    span, stride = plan.ep * plan.tp, plan.tp
    n = plan.ep
    return (n - 1) / n * nbytes / hw.group_bandwidth(span, stride) + hw.latency


def _collective(
    hw: Hardware, plan: Plan, dim: str, nbytes: float, factor: float, n: int | None = None
) -> float:
    n = n or getattr(plan, dim) or 1
    if n == 1 or nbytes == 0:
        return 0.0
    span, stride = _group(plan, dim)
    return factor * (n - 1) / n * nbytes / hw.group_bandwidth(span, stride) + hw.latency


def _tp_counts(part: PartCost, plan: Plan) -> tuple[int, int]:
    """(tp's all-reduces, tp's layers that dispatch through DTensor) of a block's
    forward. An experts module's weights never dispatch through DTensor: without ep, tp
    runs the module's own forward on their local shards (parallel/tensor/styles.py,
    `_WeightShard`: one all-reduce after all experts); beside ep, tp leaves them whole
    for ep to place, their all-reduce too."""
    reductions = part.tp_reductions - (part.expert_tp_reductions if plan.ep > 1 else 0)
    return reductions, part.tp_projections - part.expert_tp_projections


def _add_time(
    result: Estimate,
    profile: ModelProfile,
    plan: Plan,
    layout: list[tuple[list[int], bool, bool]],
    mb: float,
    hw: Hardware,
    state_bytes: float,
    compiled: bool,
) -> None:
    from meshfit.plan import SCHEDULE_TABLE

    m = plan.num_microbatches
    rate = hw.flops(plan.precision, compiled)
    # under pp meshfit compiles the blocks only; a stage's head and tail run eagerly
    ends_rate = hw.flops(plan.precision, compiled and plan.pp == 1)
    cbytes = _compute_bytes(plan, profile)
    act_scale = _activation_scale(plan)
    recompute = {"none": 0.0, "selective": 0.1, "full": 1.0}[plan.checkpointing]
    slowest = None
    for blocks, first, last in layout:
        parts = [profile.blocks[i] for i in blocks]
        flops = sum(_block_flops(p, plan.tp, experts_whole=plan.ep > 1) for p in parts)
        fwd_extra = (_block_flops(profile.head, plan.tp) if first else 0) + (
            _block_flops(profile.tail, plan.tp) if last else 0
        )
        tokens = mb / plan.cp  # a rank's share of its samples' tokens, in samples
        t_mb = (flops * (3 + recompute) / rate + fwd_extra * 3 / ends_rate) * tokens
        # fixed cost per operator: forward, about twice as many in backward, and the
        # forward again under recomputation; a GPU launches ahead of its kernels
        ops = sum(p.ops for p in parts) * (3 + recompute)
        ops += ((profile.head.ops if first else 0) + (profile.tail.ops if last else 0)) * 3
        launches = ops * hw.op_overhead * (0.3 if compiled else 1.0)
        gathered = last and _tp_of(profile.tail, plan.tp) > 1 and profile.tail.tp_gathered_outputs
        if plan.tp > 1:
            redo = 1 + (1 if plan.checkpointing == "full" else 0)
            launches += sum(_tp_counts(p, plan)[1] for p in parts) * hw.dtensor_overhead * redo
            launches += profile.tail.tp_projections * hw.dtensor_overhead if gathered else 0
        t_mb = max(t_mb, launches) if hw.launch_ahead else t_mb + launches
        # tensor parallel: every row-parallel output is all-reduced, forward and backward
        for p in parts:
            calls = _tp_counts(p, plan)[0] * (2 + (1 if plan.checkpointing == "full" else 0))
            nbytes = p.input_bytes * tokens * act_scale
            t_mb += calls * _collective(hw, plan, "tp", nbytes, 2.0)
            if plan.ep > 1 and p.dispatch_bytes:  # tokens to their experts and back,
                # forward and backward (the forward again when recomputed)
                pairs = p.dispatch_bytes * tokens * act_scale
                passes = 2 + (plan.checkpointing != "none")
                t_mb += 2 * passes * _ep_collective(hw, plan, pairs)
            if plan.cp > 1:  # K/V gathered (forward; again when recomputed), their
                # gradient summed back (backward)
                kv = _kv_bytes(p, profile) * mb * act_scale
                gathers = 1 + (plan.checkpointing != "none")
                t_mb += gathers * _collective(hw, plan, "cp", kv, 1.0)
                t_mb += _collective(hw, plan, "cp", kv, 2.0)
        if gathered and profile.blocks:  # the head's outputs gathered, its input's gradient summed
            t_mb += _collective(hw, plan, "tp", profile.output_bytes * tokens * act_scale, 1.0)
            t_mb += _collective(
                hw, plan, "tp", profile.blocks[-1].input_bytes * tokens * act_scale, 2.0
            )
        if plan.pp > 1 and parts:  # an activation out, a gradient back
            t_mb += 2 * _collective(hw, plan, "pp", parts[0].input_bytes * tokens * act_scale, 2.0)
        params = sum(_split(p, plan.tp, without_experts=plan.ep > 1) for p in parts)
        params += (_split(profile.head, plan.tp) if first else 0) + (
            _split(profile.tail, plan.tp) if last else 0
        )
        if slowest is None or t_mb > slowest[0]:
            slowest = (t_mb, params, len(parts), flops * (3 + recompute) * tokens / rate)
    assert slowest is not None
    t_mb, params, nblocks, _ = slowest
    share = SCHEDULE_TABLE[plan.schedule].bubble_share
    bubble = (plan.pp - 1) * t_mb * share if plan.pp > 1 else 0.0
    compute = m * t_mb
    # data parallel
    comm, hidden_behind = 0.0, 0.0
    if plan.ep > 1:  # the experts: neither gathered nor reduced by FSDP2/DDP; 1/ep of
        # their gradients summed over the ranks ep leaves
        experts = sum(b.expert_params for b in profile.blocks) / plan.pp
        replicas = (plan.dp or 1) * plan.fsdp * plan.cp // plan.ep
        comm += _collective(hw, plan, "dp", experts / plan.ep * GRADIENT_BYTES, 2.0, replicas)
    grad_bytes = params * GRADIENT_BYTES
    shards = _shards(plan)
    if plan.uses_fsdp:
        gathers = 2 if plan.reshard_after_forward else 1
        if shards > 1:
            comm += m * gathers * _collective(hw, plan, "fsdp", params * cbytes, 1.0, shards)
            comm += _collective(hw, plan, "fsdp", grad_bytes, 1.0, shards)
            # one gather per block and pass, one reduce-scatter per block: each pays latency
            comm += (m * gathers + 1) * nblocks * hw.latency
        comm += _collective(hw, plan, "dp", grad_bytes / shards, 2.0)
        hidden_behind = compute
        tail = comm / max(nblocks, 1)
    else:
        comm = _collective(hw, plan, "dp", grad_bytes, 2.0, (plan.dp or 1) * plan.cp)
        hidden_behind = t_mb * 2 / 3  # the last micro-batch's backward
        tail = comm * min(1.0, DDP_BUCKET_BYTES / max(grad_bytes, 1.0))
    exposed = max(comm - hidden_behind, 0.0) + min(tail, comm)
    local = params / shards
    if plan.offload:
        step = local * (8 + state_bytes) * 2 / HOST_MEMORY_BANDWIDTH
        step += local * (profile.param_bytes + GRADIENT_BYTES) / PCIE_BANDWIDTH
    else:
        step = (
            local * (profile.param_bytes + GRADIENT_BYTES + state_bytes) * 2 / hw.memory_bandwidth
        )
    result.step_time = TimeEstimate(
        compute=compute, communication=exposed, bubble=bubble, optimizer=step
    )
    total = result.step_time.total
    result.samples_per_s = result.batch_size / total
    result.tokens_per_s = result.samples_per_s * profile.tokens_per_sample
    model_flops = sum(b.flops for b in profile.blocks) + profile.head.flops + profile.tail.flops
    world = plan.world_size or 1
    done = model_flops * (3 + recompute) * result.batch_size
    result.flops_per_device = done / total / world
    peak = hw.peak_flops.get("bf16" if plan.precision == "fp8" else plan.precision)
    if peak:
        result.mfu = model_flops * 3 * result.batch_size / total / world / peak


def _gib(n: float) -> str:
    return f"{n / 1024**3:.2f} GiB" if n >= 1024**3 / 10 else f"{n / 1024**2:.1f} MiB"
