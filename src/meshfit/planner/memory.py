"""Memory per rank of one plan, from a model's profile.

Memory (bytes on the fullest rank) is what each form keeps (the ZeRO paper's
accounting, Rajbhandari et al. 2020; activations as counted in the profile):

- the peak of a step: parameters, optimizer state and buffers, plus the activations or
  the gradients with what recomputation re-makes late in backward, whichever is larger
  (both where micro-batches interleave: see MemoryEstimate); or, where larger, the
  optimizer's step: parameters, gradients and state beside DDP's buckets and the step's
  temporaries (the largest parameter's size, or all of them, by how it steps:
  STEP_TEMPORARIES, FOREACH_TEMPORARIES; none fused);
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
  re-run at a time, "selective" keeps the matrix products' outputs; under autocast
  2 bytes an element, but the loss's log-softmax and its gradient over the output stay
  float32 (autocast's op lists), and a micro-batch's loss and that gradient are freed
  before its blocks' backward re-makes a block. Under pp the last stage also holds each
  micro-batch's output (the logits) until its backward (torch's stage keeps it).
  Compiled (compile=True), what torch's partitioner saves instead
  (planner/compiled_memory.py), no float32 copy of the output and no separate gradient
  of it (Inductor writes it over the saved logits). Context parallel (cp) holds 1/cp of
  each sequence's tokens: activations and FLOPs divide by cp, but each attention keeps
  the whole sequence's keys and values it gathered (parallel/context/attention.py; the
  bytes the profile saw its attention read, two block inputs where it saw none), every
  block's without recomputation, one block's at a time with it (the gather is re-run in
  backward); and the additive mask of the rank's queries over the whole sequence, one
  per micro-batch in flight (S/cp x S in the compute dtype: quadratic in S, the price of
  an exact mask on any device). FSDP2 shards over fsdp x cp. Expert parallel (ep) keeps
  1/ep of every experts module whole (outside FSDP2), the rest as the plan says.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshfit.errors import MeshfitError
from meshfit.plan import Plan
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
# Temporaries an optimizer's step makes, by how it steps (torch's `foreach=`/`fused=`),
# measured with memory_probe (tests/test_planner.py measures them again):
# - "for-loop", one parameter at a time (torch's default on the CPU): STEP_TEMPORARIES x
#   the rank's largest parameter (AdamW: its second moment's sqrt and the quotient;
#   Adagrad's and RMSprop's one, plus the previous parameter's still bound);
# - "foreach", a list at a time (torch's default on a GPU): FOREACH_TEMPORARIES x all of
#   the rank's parameters (each operation makes its results for the whole list at once);
# - "fused", one kernel (meshfit's AdamW on a GPU): none.
# A bare "adamw" steps as meshfit's own AdamW does (fused on a GPU, one parameter at a
# time on the CPU); another bare name as torch does by default (a list at a time on a
# GPU, one at a time on the CPU); "adamw:foreach" names the implementation.
STEP_TEMPORARIES = {"adamw": 2, "adam": 2, "adagrad": 1, "rmsprop": 1}
FOREACH_TEMPORARIES = {"adamw": 1, "adam": 1, "adagrad": 2, "rmsprop": 1}
STEPPINGS = ("for-loop", "foreach", "fused")


def step_temporaries(name: str, stepping: str) -> tuple[float, float]:
    """(temporaries the size of the rank's largest parameter, the size of all its
    parameters) the step of optimizer `name` makes, stepping so (STEPPINGS)."""
    if stepping == "foreach":
        return 0, FOREACH_TEMPORARIES.get(name, 0)
    if stepping == "for-loop":
        return STEP_TEMPORARIES.get(name, 0), 0
    return 0, 0


GRADIENT_BYTES = 4  # float32 gradients (master weights stay float32 under bf16)
# Share of a device's memory a plan may fill: the allocator's fragmentation and the
# CUDA context need the rest.
USABLE_MEMORY = 0.92


@dataclass
class MemoryEstimate:
    """Bytes on one rank (device memory; with offload, state in host memory is `host`).

    Each kind is its own largest amount in the step; `total` is the step's peak. The
    gradients and the activations do not peak together in one micro-batch's step: the
    engine frees the gradients after each optimizer step, so the forward's activations
    peak before any gradient exists (measured: benchmarks/planner_memory.py), and
    backward frees activations as it makes gradients. They add up where micro-batches
    interleave: gradient accumulation, and 1F1B-style schedules that run backwards
    while other micro-batches' activations wait (`overlap`). The optimizer's step is
    the other candidate for the peak: parameters, gradients and state beside `stepping`
    (DDP's buckets, and the step's temporaries by how the optimizer steps); `total` is
    the larger."""

    parameters: float = 0.0
    gradients: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    buffers: float = 0.0
    host: float = 0.0
    # of activations: what is still held late in backward, beside nearly every gradient
    # (recomputation re-makes the first block when the others' gradients exist)
    late: float = 0.0
    # beside the parameters, gradients and optimizer state while the optimizer steps:
    # DDP's buckets and the step's own temporaries
    stepping: float = 0.0
    rank: str = ""  # which rank this is (e.g. "pp stage 0")
    overlap: bool = False  # gradients and activations held at once

    @property
    def total(self) -> float:
        if self.overlap:
            either = self.gradients + self.activations
        else:
            either = max(self.gradients + self.late, self.activations)
        step = self.parameters + self.optimizer + self.buffers + either
        return max(step, self.parameters + self.gradients + self.optimizer + self.stepping)

    def as_dict(self) -> dict[str, float]:
        fields_ = (
            "parameters", "gradients", "optimizer", "activations", "late", "stepping",
            "buffers", "host",
        )  # fmt: skip
        return {name: getattr(self, name) for name in fields_} | {"total": self.total}


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
    starts = _cached_starts(profile, stages, plan.tp, plan.ep > 1)
    bounds = [*starts, n]
    layout = []
    for r in range(plan.pp):
        blocks = [i for s in range(r, stages, plan.pp) for i in range(bounds[s], bounds[s + 1])]
        layout.append((blocks, r == 0, r == (stages - 1) % plan.pp))
    return layout


def _cached_starts(
    profile: ModelProfile, stages: int, tp: int, experts_whole: bool = False
) -> list[int]:
    """meshfit cuts after tensor parallel has split the blocks (their FLOPs are counted
    on the split model) and before expert parallel places the experts (beside ep, whole
    on every tp rank), so the cut balances the split blocks' FLOPs, among the blocks
    where a stage may start (profile.stage_starts: refused as the cut refuses, where
    none leave `stages` stages)."""
    from meshfit.parallel.pipeline.costs import StageCosts, balanced_starts

    cache = profile.__dict__.setdefault("_starts", {})
    key = (stages, tp, experts_whole)
    if key not in cache:
        costs = StageCosts(
            unit="flops",
            blocks=[_block_flops(b, tp, experts_whole) or float(b.params) for b in profile.blocks],
            head=_block_flops(profile.head, tp),
            tail=_block_flops(profile.tail, tp),
            trainable=[b.params > 0 for b in profile.blocks],
            differing=profile.stage_starts_differing,
        )
        cache[key] = balanced_starts(costs, stages, profile.stage_starts)
    return cache[key]


def optimizer_stepping(optimizer: str) -> tuple[str, str | None]:
    """("adamw", "foreach") for "adamw:foreach"; ("adamw", None) for a bare name (see
    STEPPINGS above: meshfit's AdamW, else torch's default for the device)."""
    name, _, stepping = optimizer.lower().partition(":")
    if stepping == "fused" and name == "rmsprop":
        raise MeshfitError(
            f"optimizer {optimizer!r}: torch has no fused RMSprop; use 'rmsprop:foreach' "
            f"(a list at a time) or 'rmsprop:for-loop'"
        )
    if name not in OPTIMIZER_STATE_BYTES or (stepping and stepping not in STEPPINGS):
        raise MeshfitError(
            f"unknown optimizer {optimizer!r} for planning; known: "
            f"{', '.join(OPTIMIZER_STATE_BYTES)}, each optionally with how it steps "
            f"({', '.join(':' + s for s in STEPPINGS)}, e.g. 'adamw:foreach'), or its state "
            f"bytes per parameter (a number)"
        )
    return name, stepping or None


def _optimizer_bytes(optimizer: str | float) -> float:
    if isinstance(optimizer, (int, float)):
        return float(optimizer)
    return float(OPTIMIZER_STATE_BYTES[optimizer_stepping(optimizer)[0]])


def _tp_of(part: PartCost, tp: int) -> int:
    """The tp that splits `part`: 1 for a head whose outputs tp does not divide."""
    outputs = part.tp_gathered_outputs
    return 1 if outputs and outputs % tp else tp


def _split(part: PartCost, tp: int, without_experts: bool = False) -> float:
    """Parameters of `part` on one tp rank; `without_experts`: of what is not its
    experts' (beside ep, tp leaves the experts whole and ep places them)."""
    tp = _tp_of(part, tp)
    if tp == 1:
        return float(part.params - (part.expert_params if without_experts else 0))
    if not without_experts:
        return part.params * (1 - part.tp_share + part.tp_share / tp)
    share = _dense_tp_share(part)
    return (part.params - part.expert_params) * (1 - share + share / tp)


def _dense_tp_share(part: PartCost) -> float:
    """The fraction of `part`'s parameters outside its experts that tp splits: the
    derived plan's share, the experts taken to be all split (tp splits them where ep does
    not take them)."""
    dense = part.params - part.expert_params
    if dense <= 0:
        return 0.0
    return min(max(part.params * part.tp_share - part.expert_params, 0.0), dense) / dense


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


def _block_activations(part: PartCost, plan: Plan, traced: bool) -> tuple[float, float]:
    """(bytes kept per sample for backward, bytes re-made at once during its backward),
    in the compute dtype: the compiled partition's count where `traced`. Beside ep, tp
    leaves the experts whole: what they keep is whole on every tp rank."""
    tp = plan.tp if part.tp_share > 0 else 1
    scale = _activation_scale(plan)
    experts_whole = plan.ep > 1 and tp > 1
    saved_split = part.saved_split - (part.expert_saved_split if experts_whole else 0.0)
    whole = (part.saved - saved_split + saved_split / tp) * scale
    if traced and part.compiled_saved is not None:
        split = part.compiled_saved_split
        whole = part.compiled_saved - split + split / tp
    if plan.checkpointing == "full":
        return part.input_bytes * scale, whole
    if plan.checkpointing == "selective":
        kept_split = part.kept_selective_split - (part.expert_kept_split if experts_whole else 0)
        kept = part.kept_selective - kept_split + kept_split / tp
        kept = (kept + part.input_bytes) * scale
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
    traced: bool = False,
    chunked_loss: bool | int = False,
    step_temporaries: tuple[float, float] = (0, 0),
) -> MemoryEstimate:
    parts = [profile.blocks[i] for i in blocks]
    block_params = sum(_split(p, plan.tp, without_experts=plan.ep > 1) for p in parts)
    rest = (_split(profile.head, plan.tp) if first else 0) + (
        _split(profile.tail, plan.tp) if last else 0
    )
    if first and last:
        rest -= profile.tied_params  # one stage: a tied weight is one tensor
    local = (block_params + rest) / _shards(plan)
    if plan.ep > 1:  # the experts: whole (tp leaves them), 1/ep of them per rank, outside FSDP2
        local += sum(p.expert_params for p in parts) / plan.ep
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
        memory.stepping += local * GRADIENT_BYTES
    # the optimizer's temporaries: one parameter at a time, the size of the rank's
    # largest parameter (measured: 250.5 MiB beside a 125 MiB embedding, where a
    # 128k-word Llama's chunked step under tp=2 peaks); a block's split by tp, the head's
    # and tail's taken whole (an embedding tp may leave whole). A list at a time (foreach),
    # the size of all the rank's parameters. With offload they are the host's (the
    # optimizer steps there).
    of_largest, of_all = step_temporaries
    sizes = [_largest_local(p, plan) for p in parts]
    sizes += [profile.head.largest_param / _shards(plan)] if first else []
    sizes += [profile.tail.largest_param / _shards(plan)] if last else []
    largest = max(sizes, default=0)
    if not plan.offload:
        memory.stepping += (of_largest * largest + of_all * local) * 4
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
    elif plan.uses_fsdp and parts:  # (not the experts beside ep: FSDP2 leaves them)
        largest = max(_split(p, plan.tp, without_experts=plan.ep > 1) for p in parts)
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
        k, r = _block_activations(part, plan, traced)
        kept += k
        remade = max(remade, r)
    # under pp the stage's prologue and epilogue run eagerly (parallel/compiled.py)
    ends_traced = traced and plan.pp == 1
    if first:
        head_traced = ends_traced and profile.head.compiled_saved is not None
        kept += profile.head.compiled_saved if head_traced else profile.head.saved * scale
    tail = output_gradient = 0.0
    tokens = mb / plan.cp  # a rank's share of its samples' tokens, in samples
    loss_kept = loss_phase = 0.0  # bytes, not per sample: chunked_loss's
    if last and chunked_loss:  # the logits never whole (parallel/head_loss.py)
        tail = (profile.tail.saved - profile.loss_float32) * scale
        loss_kept, loss_phase = _chunked_loss_bytes(
            profile, plan, tokens, cbytes, chunked_loss, compiled=ends_traced
        )
    elif last:
        tail_traced = ends_traced and profile.tail.compiled_saved is not None
        tail = profile.tail.compiled_saved if tail_traced else profile.tail.saved * scale
        if not tail_traced:  # autocast keeps the loss's log-softmax in float32
            tail += profile.loss_float32 * (1 - scale)
            # and its gradient over the output, float32, two copies beside it; compiled,
            # Inductor writes it over the saved logits (its in-place buffer reuse)
            output_gradient = 2 * profile.output_bytes
    if last and plan.pp > 1 and not chunked_loss and not profile.output_saved:
        # torch's stage keeps each micro-batch's output (the logits) from its forward
        # until its backward has run (one process drops it before backward); with
        # chunked_loss the last stage's output is the hidden state (head_loss.py); a
        # loss that saves the output itself has it in tail.saved already
        tail += profile.output_bytes * scale
    # A micro-batch's loss and its gradient are freed before its blocks' backward
    # re-makes a block (recomputation): the two do not meet.
    flight = in_flight(plan, rank)
    loss = (tail + output_gradient) * tokens + loss_kept + loss_phase
    held = (kept * flight + tail * (flight - 1)) * tokens + loss_kept * (flight - 1)
    memory.activations = held + max(loss, remade * tokens)
    memory.late = remade * tokens
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
    if plan.pp > 1 and parts:  # receive buffers: an activation and a gradient
        memory.buffers += 2 * parts[0].input_bytes * tokens * scale
    if plan.offload:
        memory.host = memory.parameters + memory.gradients + memory.optimizer
        memory.parameters = memory.gradients = memory.optimizer = 0.0
    return memory


def _kv_bytes(part: PartCost, profile: ModelProfile) -> float:
    """The keys and values a block's attention reads, per sample: as profiled, else (no
    block's attention seen: written by hand) two block inputs, an upper bound."""
    if any(b.attention_kv_bytes for b in profile.blocks):
        return part.attention_kv_bytes
    return 2 * part.input_bytes


def _largest_local(part: PartCost, plan: Plan) -> float:
    """Elements of a block's largest parameter on one rank: tp splits the block's, fsdp
    shards them; under ep an expert weight holds 1/ep of the experts, outside FSDP2."""
    split = _tp_of(part, plan.tp) if part.tp_share else 1
    if plan.ep > 1:
        return max(part.largest_param / split / _shards(plan), part.largest_expert / plan.ep)
    return max(part.largest_param, part.largest_expert) / split / _shards(plan)


def _shards(plan: Plan) -> int:
    """The ranks a parameter is sharded over: FSDP2 shards over fsdp x cp."""
    return plan.fsdp * plan.cp if plan.uses_fsdp else plan.fsdp


def _block_flops(part: PartCost, tp: int, experts_whole: bool = False) -> float:
    """A part's forward FLOPs per sample on one tp rank; `experts_whole` (ep beside tp):
    every tp rank computes its experts whole (their share of the work is not divided)."""
    tp = _tp_of(part, tp)
    if tp == 1 or part.tp_share == 0:
        return part.flops
    if experts_whole and part.expert_params:
        dense = part.flops - part.attention_flops - part.expert_flops
        share = _dense_tp_share(part)
        return dense * (1 - share + share / tp) + part.attention_flops / tp + part.expert_flops
    dense = part.flops - part.attention_flops
    return dense * (1 - part.tp_share + part.tp_share / tp) + part.attention_flops / tp


def _chunked_loss_bytes(
    profile: ModelProfile,
    plan: Plan,
    samples: float,
    cbytes: float,
    chunked: bool | int,
    compiled: bool = False,
) -> tuple[float, float]:
    """(bytes kept from the loss's forward to its backward, bytes of its forward's
    largest moment) of chunked_loss (parallel/head_loss.py) for one micro-batch of
    `samples`. Kept: the head weight's gradient, accumulated in float32. The largest of
    a chunk's moments: its logits (compute dtype) beside their float32 log-softmax (and
    the float32 copy log_softmax makes of narrower logits); the log-softmax turned in
    place into the gradient beside its cast back; that cast beside the weight gradient's
    product and its float32 copy. Compiled, Inductor fuses the log-softmax, the gradient
    and its cast into kernels that write the gradient over the logits (its in-place buffer
    reuse): the last moment is the largest."""
    from meshfit.parallel.head_loss import CHUNK_LOGITS

    length = max(profile.tokens_per_sample, 1)
    whole = profile.output_bytes / (length * profile.param_bytes)  # the vocabulary
    # tokens a chunk: sized from the whole vocabulary (head_loss.install), also under tp
    per_chunk = chunked if chunked is not True else max(1, CHUNK_LOGITS // max(whole, 1))
    vocabulary = whole
    if _tp_of(profile.tail, plan.tp) > 1 and profile.tail.tp_gathered_outputs:
        vocabulary /= plan.tp  # each rank's rows of a head split over the vocabulary
    width = profile.blocks[-1].input_bytes / (length * profile.param_bytes) if profile.blocks else 0
    head = vocabulary * width
    logits = min(per_chunk, samples * length) * vocabulary
    narrow = cbytes < 4  # the logits narrower than the loss's float32
    product = logits * cbytes + head * (cbytes + (4 if narrow else 0))
    if compiled:
        return head * 4, product
    widened = logits * (cbytes + 4 + (4 if narrow else 0))
    return head * 4, max(widened, logits * (4 + cbytes) if narrow else 0.0, product)
