"""Memory per rank and time per step of one plan, from a model's profile and hardware.

Memory (bytes on the fullest rank) is what each form keeps (the ZeRO paper's
accounting, Rajbhandari et al. 2020; activations as counted in the profile):

- the peak of a step: parameters, optimizer state and buffers, plus the activations or
  the gradients, whichever is larger (both where micro-batches interleave: see
  MemoryEstimate);
- parameters 4 bytes, gradients 4, optimizer state 8 (Adam: two moments) per element of
  the rank's share: a pipeline stage's parameters, tp-split ones divided by tp, all of
  them divided by fsdp (ZeRO-3: 16 bytes / parameter / N);
- buffers: DDP keeps its gradient buckets beside the gradients (one more gradient copy);
  FSDP2 gathers two blocks' parameters at a time (the running one and the prefetched one)
  and one block's unsharded gradients, and keeps the root's (embeddings, head) gathered
  through the step; autocast keeps 2-byte copies of the weights for backward;
- activations: the profile's saved bytes of the rank's blocks per sample x the
  micro-batch x the micro-batches in flight (no pipeline: 1; GPipe: all; 1F1B: pp - stage;
  interleaved: its warm-up), "full" recomputation keeps block inputs only plus one block
  re-run at a time, "selective" keeps the matrix products' outputs. Context parallel
  (cp) holds 1/cp of each sequence's tokens: activations and FLOPs divide by cp, but
  each attention keeps the whole sequence's keys and values it gathered
  (parallel/context/attention.py; the bytes the profile saw its attention read, two
  block inputs where it saw none), every block's without recomputation, one block's at a
  time with it (the gather is re-run in backward); and the additive mask of the rank's
  queries over the whole sequence, one per micro-batch in flight (S/cp x S in the
  compute dtype: quadratic in S, the price of an exact mask on any device). FSDP2 shards
  over fsdp x cp. Expert parallel (ep) keeps 1/ep of every experts module whole (outside
  FSDP2), the rest as the plan says.

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
from meshfit.planner.profile import ModelProfile, PartCost

# meshfit.parallel.pipeline is imported inside the functions that need it: the package
# loads torch.distributed.pipelining (and sympy), ~1.2 s that `import meshfit` must not pay.

# Optimizer state bytes per parameter element (float32 state).
OPTIMIZER_STATE_BYTES = {
    "adamw": 8,
    "adam": 8,
    "sgd": 0,
    "sgd-momentum": 4,
    "adagrad": 4,
    "rmsprop": 4,
}
GRADIENT_BYTES = 4  # float32 gradients (master weights stay float32 under bf16)
DDP_BUCKET_BYTES = 25 * 1024**2  # DDP's default bucket: the last one cannot hide
# Share of a device's memory a plan may fill: the allocator's fragmentation and the
# CUDA context need the rest.
USABLE_MEMORY = 0.92
PCIE_BANDWIDTH = 25e9  # host <-> device per GPU (PCIe 4/5 x16, usable): offload's transfers
HOST_MEMORY_BANDWIDTH = 10e9  # per process: offload's optimizer step runs on the CPU


@dataclass
class MemoryEstimate:
    """Bytes on one rank (device memory; with offload, state in host memory is `host`).

    Each kind is its own largest amount in the step; `total` is the step's peak. The
    gradients and the activations do not peak together in one micro-batch's step: the
    engine frees the gradients after each optimizer step, so the forward's activations
    peak before any gradient exists (measured: benchmarks/planner_memory.py), and
    backward frees activations as it makes gradients. They add up where micro-batches
    interleave: gradient accumulation, and 1F1B-style schedules that run backwards
    while other micro-batches' activations wait (`overlap`)."""

    parameters: float = 0.0
    gradients: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    buffers: float = 0.0
    host: float = 0.0
    rank: str = ""  # which rank this is (e.g. "pp stage 0")
    overlap: bool = False  # gradients and activations held at once

    @property
    def total(self) -> float:
        if self.overlap:
            either = self.gradients + self.activations
        else:
            either = max(self.gradients, self.activations)
        return self.parameters + self.optimizer + self.buffers + either

    def as_dict(self) -> dict[str, float]:
        fields_ = ("parameters", "gradients", "optimizer", "activations", "buffers", "host")
        return {name: getattr(self, name) for name in fields_} | {"total": self.total}


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
) -> Estimate:
    """The Estimate of `plan` (dp resolved) for a global batch of `batch_size`;
    `compiled`: the run uses parallelize(..., compile=True)."""
    if plan.dp is None:
        if hardware is None:
            raise MeshfitError("give the plan's dp, or hardware to resolve dp=auto from")
        plan = plan.resolve(hardware.world_size)
    state_bytes = _optimizer_bytes(optimizer)
    m = plan.num_microbatches
    per_rank = batch_size / plan.data_parallel_size
    mb = per_rank / m
    layout = stage_layout(profile, plan)
    ranks = [
        _rank_memory(profile, plan, blocks, first, last, r, mb, state_bytes)
        for r, (blocks, first, last) in enumerate(layout)
    ]
    fullest = max(ranks, key=lambda e: e.total)
    result = Estimate(plan=plan, batch_size=batch_size, memory=fullest, ranks=ranks)
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


def build_bytes(profile: ModelProfile, ranks: list[MemoryEstimate], tp: int = 1) -> float:
    """Peak bytes of one rank while the engine is built. On meta a rank materializes
    only its part, a split parameter's full value beside it (a whole one takes its
    value's storage: materialize.py); under tp it first traces the split on a twin of
    the model with one block, materialized whole, beside which the backward check keeps
    that block's gradients, and frees it before its own part (parallel/tensor/meta.py).
    A model built on the device is whole on every rank first."""
    if profile.built_on_meta:
        share = max(r.parameters + r.host for r in ranks) + profile.largest_param * (
            profile.param_bytes
        )
        if tp > 1 and profile.blocks:
            block = max(b.params for b in profile.blocks)
            twin = profile.total_params - profile.block_params + block
            share = max(share, (twin + block) * profile.param_bytes)
        return share
    return float(profile.total_params * profile.param_bytes)


def stage_layout(profile: ModelProfile, plan: Plan) -> list[tuple[list[int], bool, bool]]:
    """Per pipeline rank: (its block indices, holds the head, holds the tail). The cut
    balances FLOPs, as meshfit's own cut does (pipeline/costs.py)."""
    from meshfit.plan import VIRTUAL_STAGES

    n = len(profile.blocks)
    if plan.pp == 1:
        return [(list(range(n)), True, True)]
    virtual = VIRTUAL_STAGES[plan.schedule]
    stages = plan.pp * virtual
    if stages > n:
        raise MeshfitError(
            f"{stages} pipeline stages need at least {stages} blocks; the model has {n}"
        )
    starts = _cached_starts(profile, stages, plan.tp)
    bounds = [*starts, n]
    layout = []
    for r in range(plan.pp):
        blocks = [i for s in range(r, stages, plan.pp) for i in range(bounds[s], bounds[s + 1])]
        layout.append((blocks, r == 0, r == (stages - 1) % plan.pp))
    return layout


def _cached_starts(profile: ModelProfile, stages: int, tp: int) -> list[int]:
    """meshfit cuts after tensor parallel has split the blocks (their FLOPs are counted
    on the split model), so the cut balances the split blocks' FLOPs."""
    from meshfit.parallel.pipeline.costs import StageCosts, balanced_starts

    cache = profile.__dict__.setdefault("_starts", {})
    if (stages, tp) not in cache:
        costs = StageCosts(
            unit="flops",
            blocks=[_block_flops(b, tp) or float(b.params) for b in profile.blocks],
            head=_block_flops(profile.head, tp),
            tail=_block_flops(profile.tail, tp),
            trainable=[b.params > 0 for b in profile.blocks],
        )
        cache[stages, tp] = balanced_starts(costs, stages)
    return cache[stages, tp]


def _optimizer_bytes(optimizer: str | float) -> float:
    if isinstance(optimizer, (int, float)):
        return float(optimizer)
    key = optimizer.lower()
    if key not in OPTIMIZER_STATE_BYTES:
        raise MeshfitError(
            f"unknown optimizer {optimizer!r} for planning; known: "
            f"{', '.join(OPTIMIZER_STATE_BYTES)}, or its state bytes per parameter (a number)"
        )
    return float(OPTIMIZER_STATE_BYTES[key])


def _tp_of(part: PartCost, tp: int) -> int:
    """The tp that splits `part`: 1 for a head whose outputs tp does not divide."""
    outputs = part.tp_gathered_outputs
    return 1 if outputs and outputs % tp else tp


def _split(part: PartCost, tp: int) -> float:
    """Parameters of `part` on one tp rank."""
    tp = _tp_of(part, tp)
    if tp == 1:
        return float(part.params)
    return part.params * (1 - part.tp_share + part.tp_share / tp)


# Precisions that compute under 2-byte autocast (fp8: bf16 around its float8 matmuls,
# whose speed-up the estimate does not count: it plans fp8 as bf16).
_AUTOCAST = ("bf16", "fp16", "fp8")


def _compute_bytes(plan: Plan, profile: ModelProfile) -> float:
    return 2.0 if plan.precision in _AUTOCAST else float(profile.param_bytes)


def _activation_scale(plan: Plan) -> float:
    # Under autocast most saved tensors are the 2-byte inputs and outputs of matrix
    # products; the profile counted them at the model's float32.
    return 0.5 if plan.precision in _AUTOCAST else 1.0


def in_flight(plan: Plan, rank: int) -> float:
    """Micro-batches whose activations pipeline rank `rank` holds at its peak (the
    schedule's own count: plan.SCHEDULE_TABLE)."""
    from meshfit.plan import SCHEDULE_TABLE

    if plan.pp == 1:
        return 1.0
    return SCHEDULE_TABLE[plan.schedule].in_flight(plan.num_microbatches, plan.pp, rank)


def _block_activations(part: PartCost, plan: Plan) -> tuple[float, float]:
    """(bytes kept per sample for backward, bytes re-made at once during its backward)."""
    tp = plan.tp if part.tp_share > 0 else 1
    whole = part.saved - part.saved_split + part.saved_split / tp
    if plan.checkpointing == "full":
        return part.input_bytes, whole
    if plan.checkpointing == "selective":
        kept = part.kept_selective - part.kept_selective_split + part.kept_selective_split / tp
        kept += part.input_bytes
        return min(kept, whole), max(whole - kept, 0.0)
    return whole, 0.0


def _rank_memory(
    profile: ModelProfile,
    plan: Plan,
    blocks: list[int],
    first: bool,
    last: bool,
    rank: int,
    mb: float,
    state_bytes: float,
) -> MemoryEstimate:
    parts = [profile.blocks[i] for i in blocks]
    block_params = sum(_split(p, plan.tp) for p in parts)
    rest = (_split(profile.head, plan.tp) if first else 0) + (
        _split(profile.tail, plan.tp) if last else 0
    )
    if first and last:
        rest -= profile.tied_params  # one stage: a tied weight is one tensor
    local = (block_params + rest) / _shards(plan)
    if plan.ep > 1:  # the experts: whole, 1/ep of them per rank, outside FSDP2
        experts = sum(p.expert_params for p in parts)
        local += experts / plan.ep - experts / _shards(plan)
    cbytes = _compute_bytes(plan, profile)
    memory = MemoryEstimate(
        parameters=local * profile.param_bytes,
        gradients=local * GRADIENT_BYTES,
        optimizer=local * state_bytes,
        rank=f"pp stage {rank}" if plan.pp > 1 else "every rank",
        # gradient accumulation, or a schedule that runs backwards between forwards
        overlap=plan.num_microbatches > 1 and (plan.pp == 1 or plan.schedule != "gpipe"),
    )
    # buffers
    if (plan.dp or 1) * plan.cp > 1 and not plan.uses_fsdp:
        memory.buffers += local * GRADIENT_BYTES  # DDP's gradient buckets
    # FSDP2 gathers into unsharded copies even over a shard group of one (HSDP that only
    # replicates, as dp x tp plans do): torch copies the shard in, it does not alias it.
    if plan.defers_stage_reduction and plan.fsdp > 1 and parts:
        # torch's schedule keeps the stage gathered, with its unsharded gradients, for
        # one reduce-scatter at the step's end (parallel/fsdp.py). Measured on the
        # planner's GPT (benchmarks/planner_memory.py), fsdp=2,pp=2, 1F1B, 4 micro-
        # batches: 8.25 MiB; 8.70 counted so, 7.80 per block. Not for a shard group of
        # one (dp x tp x pp replicas): its 3-D plan measured 5.83 MiB, 6.23 per block and
        # 6.77 counted so.
        memory.buffers += (block_params + rest) * (cbytes + GRADIENT_BYTES)
    elif plan.uses_fsdp and parts:
        largest = max(_split(p, plan.tp) for p in parts)
        memory.buffers += 2 * largest * cbytes + largest * GRADIENT_BYTES
        if plan.reshard_after_forward:
            memory.buffers += rest * cbytes  # the root stays gathered
        else:
            memory.buffers += block_params * cbytes  # every block stays gathered
    if plan.precision in _AUTOCAST and not (plan.uses_fsdp and plan.fsdp > 1):
        # autocast's 2-byte weight copies, saved for backward by every micro-batch in
        # flight; recomputation re-makes them in backward instead, one block at a time.
        copies = in_flight(plan, rank) if plan.checkpointing == "none" else 1
        memory.buffers += (block_params + rest) * 2 * copies
    # activations
    scale = _activation_scale(plan)
    kept = remade = 0.0
    for part in parts:
        k, r = _block_activations(part, plan)
        kept += k
        remade = max(remade, r)
    per_microbatch = (
        kept + (profile.head.saved if first else 0) + (profile.tail.saved if last else 0)
    )
    tokens = mb / plan.cp  # a rank's share of its samples' tokens, in samples
    memory.activations = (per_microbatch * in_flight(plan, rank) + remade) * tokens * scale
    if plan.cp > 1:  # attention keeps the whole sequence's gathered K/V for backward
        gathered = [_kv_bytes(p, profile) * (1 - 1 / plan.cp) for p in parts]
        if plan.checkpointing == "none":
            memory.activations += sum(gathered) * in_flight(plan, rank) * mb * scale
        else:  # recomputation gathers them again: one block's at a time
            memory.activations += max(gathered, default=0.0) * mb * scale
        # the attention mask of the rank's queries over the whole sequence, one per
        # micro-batch shared by the layers (attention.py), in the compute dtype
        length = profile.tokens_per_sample
        memory.activations += length / plan.cp * length * cbytes * in_flight(plan, rank)
    if last:  # the output's gradient, float32, beside the kept log-softmax
        memory.buffers += 2 * profile.output_bytes * tokens
    if plan.pp > 1 and parts:  # receive buffers: an activation and a gradient
        memory.buffers += 2 * parts[0].input_bytes * tokens * scale
    if plan.offload:
        memory.host = memory.parameters + memory.gradients + memory.optimizer
        memory.parameters = memory.gradients = memory.optimizer = 0.0
    return memory


def _group(plan: Plan, dim: str) -> tuple[int, int]:
    """(span, stride) of `dim`'s groups in the mesh (the Topology's MESH_ORDER)."""
    from meshfit.topology import MESH_ORDER

    degrees = plan.degrees
    inner = MESH_ORDER[MESH_ORDER.index(dim) + 1 :]
    stride = 1
    for name in inner:
        stride *= degrees[name] or 1
    return stride * (degrees[dim] or 1), stride


def _kv_bytes(part: PartCost, profile: ModelProfile) -> float:
    """The keys and values a block's attention reads, per sample: as profiled, else (no
    block's attention seen: written by hand) two block inputs, an upper bound."""
    if any(b.attention_kv_bytes for b in profile.blocks):
        return part.attention_kv_bytes
    return 2 * part.input_bytes


def _ep_collective(hw: Hardware, plan: Plan, nbytes: float) -> float:
    """An all-to-all of `nbytes` per rank over the ep group: neighbouring loss ranks
    (topology.py), tp ranks apart; each rank keeps 1/ep of its bytes."""
    span, stride = plan.ep * plan.tp, plan.tp
    n = plan.ep
    return (n - 1) / n * nbytes / hw.group_bandwidth(span, stride) + hw.latency


def _shards(plan: Plan) -> int:
    """The ranks a parameter is sharded over: FSDP2 shards over fsdp x cp."""
    return plan.fsdp * plan.cp if plan.uses_fsdp else plan.fsdp


def _collective(
    hw: Hardware, plan: Plan, dim: str, nbytes: float, factor: float, n: int | None = None
) -> float:
    n = n or getattr(plan, dim) or 1
    if n == 1 or nbytes == 0:
        return 0.0
    span, stride = _group(plan, dim)
    return factor * (n - 1) / n * nbytes / hw.group_bandwidth(span, stride) + hw.latency


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
        flops = sum(_block_flops(p, plan.tp) for p in parts)
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
            launches += sum(p.tp_projections for p in parts) * hw.dtensor_overhead * redo
            launches += profile.tail.tp_projections * hw.dtensor_overhead if gathered else 0
        t_mb = max(t_mb, launches) if hw.launch_ahead else t_mb + launches
        # tensor parallel: every row-parallel output is all-reduced, forward and backward
        for p in parts:
            calls = p.tp_reductions * (2 + (1 if plan.checkpointing == "full" else 0))
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
        params = sum(_split(p, plan.tp) for p in parts)
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
        params -= experts
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


def _block_flops(part: PartCost, tp: int) -> float:
    tp = _tp_of(part, tp)
    if tp == 1 or part.tp_share == 0:
        return part.flops
    dense = part.flops - part.attention_flops
    return dense * (1 - part.tp_share + part.tp_share / tp) + part.attention_flops / tp


def _gib(n: float) -> str:
    return f"{n / 1024**3:.2f} GiB" if n >= 1024**3 / 10 else f"{n / 1024**2:.1f} MiB"
