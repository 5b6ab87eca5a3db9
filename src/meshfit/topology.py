"""Topology: the one owner of the parallel dimensions, as torchtitan's ParallelDims.

It knows every dimension (`DIMS`: its place in the mesh order and why, its roles), turns
a Plan into this job's world (dp filled in, an elastic world fitted, validated once),
starts the process group, builds the device mesh, and hands out its sub-meshes and
groups by role. Forms, runners, the Engine and checkpoints ask it for a role ("the ranks
the batch is split over", "the ranks one layer is split over") and never name a
dimension; `tensor/state.py` and `placements.py` tell tp's shards from FSDP2's by the
mesh dimension a DTensor names, compared with TENSOR_PARALLEL from here.

Roles:
    batch:    the ranks the global batch's samples are split over (dp x fsdp:
              batch_groups, dp_rank; BatchNorm statistics, gathered contrastive rows);
    loss:     the ranks a step's loss, metrics and gradients are summed or averaged over
              (dp x fsdp x cp: loss_groups, batch_sum, batch_mean, grad_average_size);
    replica:  data-parallel replicas (dp: with shard, FSDP2's data_mesh; DDP averages
              over every loss dimension, replica_group);
    shard:    the ranks FSDP2 shards over (fsdp x cp);
    sequence: the ranks each sequence is cut over (cp: cp_mesh);
    tensor:   the ranks one layer is split over (tp_mesh);
    pipeline: the stages of one replica (pp_mesh, pipeline_groups, pipeline_ends_group).

A dimension exists on the mesh only when its degree is above 1, except "fsdp", which
exists whenever data parallelism runs on FSDP2 (Plan.uses_fsdp: FSDP2 given ("dp",
"fsdp") replicates over the first and shards over the second).

Expert parallel (`ep`) is not a dimension of the mesh: it borrows its ranks from the
loss ranks (dp x fsdp x cp), as Megatron and torchtitan do: the loss ranks reshaped to
(loss // ep, ep) between the pipeline and tensor dimensions, the experts spread over "ep"
(neighbouring loss ranks: the innermost, whose links are the fastest, carry the
all-to-alls; `ep_mesh`) and replicated over the other dimension, whose ranks sum the
experts' gradients (`expert_replica_group`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshfit.errors import MeshfitError
from meshfit.launch.elastic import elastic_nodes
from meshfit.launch.process_group import env_world_size, init_distributed, is_distributed
from meshfit.plan import Plan


@dataclass(frozen=True)
class Dim:
    """One parallel dimension: its name (a Plan field), its roles, and why it sits
    where it does in the mesh order (outermost first: adjacent ranks share a node, so
    the chattiest dimension goes innermost)."""

    name: str
    roles: frozenset[str]
    why: str


DIMS = (
    Dim("pp", frozenset({"pipeline"}), "stages exchange one activation per micro-batch: the least traffic"),
    Dim("dp", frozenset({"batch", "loss", "replica"}), "replicas all-reduce the gradients once per step"),
    Dim("fsdp", frozenset({"batch", "loss", "shard"}), "shards gather each block's weights and reduce-scatter its gradients"),
    # inside fsdp (torchtitan's order): every attention gathers the group's keys and
    # values, forward and backward, more often than FSDP2 gathers a block's weights
    Dim("cp", frozenset({"loss", "shard", "sequence"}), "keys and values gathered in every attention layer"),
    Dim("tp", frozenset({"tensor"}), "two all-reduces per block in forward and in backward: the most traffic"),
)  # fmt: skip
MESH_ORDER = tuple(d.name for d in DIMS)


def dims_with(role: str) -> tuple[str, ...]:
    """The dimensions that take part in `role`, outermost first."""
    return tuple(d.name for d in DIMS if role in d.roles)


# The mesh dimension of tensor parallel: DTensors that tp made carry it in their own mesh
# (tensor/state.py and placements.py tell tp's chunked splits from FSDP2's by it).
[TENSOR_PARALLEL] = dims_with("tensor")


def fit_plan(plan: Plan, world_size: int) -> Plan:
    """`plan` for `world_size` processes of an elastic run (`meshfit run --nnodes
    MIN:MAX`): dp=auto fills the world as always; a plan with a fixed dp keeps fsdp x tp
    x pp and takes the dp that fills the re-formed world; one whose fsdp x tp x pp does
    not divide it is refused in one line."""
    if plan.dp is None or plan.world_size == world_size:
        return plan.resolve(world_size)
    fitted = plan.with_dp_for(world_size)
    if fitted is None:
        raise MeshfitError(
            f"the elastic run's group re-formed with {world_size} processes, and plan {plan} "
            f"needs a multiple of {plan.replica_degrees} = {plan.processes_per_replica}; "
            f"choose MIN so that every node count from MIN to MAX gives such a multiple, or "
            f"a plan whose {plan.replica_degrees} divides the workers of one node"
        )
    return fitted


def build_mesh(plan: Plan, device: torch.device) -> DeviceMesh | None:
    """A DeviceMesh with the plan's dimensions that are larger than 1, in MESH_ORDER; None
    for a single process. With data parallelism on FSDP2 (Plan.uses_fsdp) the mesh
    always has "fsdp", of size 1 if need be: FSDP2 given ("dp", "fsdp") replicates over
    the first and shards over the second (HSDP), so dp replicas stay replicas."""
    if not is_distributed() or (plan.world_size == 1 and not plan.uses_fsdp):
        return None
    sizes = {name: size for name, size in plan.degrees.items() if size and size > 1}
    if plan.uses_fsdp:  # FSDP2's own dimension, kept at size 1 for plain replicas
        sizes["fsdp"] = plan.fsdp
    names = tuple(name for name in MESH_ORDER if name in sizes)
    return init_device_mesh(device.type, tuple(sizes[n] for n in names), mesh_dim_names=names)


@dataclass
class Topology:
    """A resolved plan on this job's processes: mesh, groups, sizes, coordinates."""

    plan: Plan  # resolved: dp is a number
    device: torch.device
    mesh: DeviceMesh | None  # None for a single process
    rank: int = 0
    world_size: int = 1
    # The ranks the global batch's samples are split over (replicated and sharded data
    # parallel), and those a loss is summed over (those, and the sequence chunks).
    batch_groups: list[dist.ProcessGroup] = field(default_factory=list)
    loss_groups: list[dist.ProcessGroup] = field(default_factory=list)
    dp_size: int = 1  # how many ways the global batch is split: dp x fsdp
    dp_rank: int = 0  # this rank's share of it
    # Start-up lines on what meshfit chose for this plan (fit prints them)
    notes: list[str] = field(default_factory=list)
    _experts: tuple | None = None  # expert parallel's mesh and group, made on first use

    @classmethod
    def create(cls, plan: Plan) -> Topology:
        """This job's Topology: `plan` fitted to the world the launcher started (dp=None
        fills what is left) and validated (the one place), then the process group started
        and the mesh built."""
        # Checked before the group starts: a rank that refused the plan after joining
        # could exit while a peer still connects, and the peer's "Connection reset"
        # traceback followed the one-line refusal (seen once in the suite).
        world = env_world_size()
        resolved = fit_plan(plan, world) if elastic_nodes() else plan.resolve(world)
        resolved.validate()
        device = init_distributed(alone=plan.offload)  # offload runs on FSDP2
        mesh = build_mesh(resolved, device)
        topology = cls(
            plan=resolved,
            device=device,
            mesh=mesh,
            rank=dist.get_rank() if is_distributed() else 0,
            world_size=resolved.world_size or 1,
            dp_size=resolved.data_parallel_size,
        )
        for name in dims_with("batch"):  # outer before inner: the rank's place in the batch
            if topology.has(name):
                topology.dp_rank = topology.dp_rank * mesh[name].size() + mesh.get_local_rank(name)
                if mesh[name].size() > 1:
                    topology.batch_groups.append(mesh.get_group(name))
        for name in dims_with("loss"):
            if topology.has(name) and mesh[name].size() > 1:
                topology.loss_groups.append(mesh.get_group(name))
        return topology

    @property
    def random_stream(self) -> int:
        """Which stream of random numbers (dropout) this rank draws: one per data shard
        and pipeline stage. Ranks that differ only in their tensor-parallel place compute
        the same replicated activations, so they must draw the same masks (with their own
        masks the tp ranks' copies of every replicated weight drifted apart: a
        different run)."""
        stages, chunks = self._only("pipeline"), self._only("sequence")
        pp_rank = self.mesh.get_local_rank(stages) if self.has(stages) else 0
        cp_rank = self.mesh.get_local_rank(chunks) if self.has(chunks) else 0
        return (self.dp_rank * self.plan.cp + cp_rank) * self.plan.pp + pp_rank

    @property
    def grad_average_size(self) -> int:
        """Over how many ranks the data-parallel wrappers average gradients (DDP and
        FSDP2 divide by their group's size): what a (sum, count) loss's gradients are
        scaled back up by (losses.normalise_by_count). The loss ranks: dp x fsdp x cp."""
        return self.dp_size * self.plan.cp

    @property
    def batch_parts(self) -> int:
        """How many parts a step's global batch is cut into: one per data-parallel rank
        (dp x fsdp), each cut again into the plan's micro-batches."""
        return self.parts(self.plan.num_microbatches)

    def parts(self, microbatches: int) -> int:
        """How many parts a global batch is cut into with `microbatches` per rank."""
        return self.dp_size * microbatches

    def local_batch(self, global_batch: int) -> int:
        """This rank's samples of a `global_batch`-sample step (before micro-batches)."""
        return global_batch // self.dp_size

    def microbatch_size(self, global_batch: int) -> int:
        """Samples in one micro-batch of a `global_batch`-sample step (at least 1)."""
        return max(1, global_batch // self.batch_parts)

    def has(self, dim: str) -> bool:
        """Whether the mesh has the dimension `dim`."""
        return self.mesh is not None and dim in (self.mesh.mesh_dim_names or ())

    def group(self, dim: str) -> dist.ProcessGroup | None:
        """The process group of `dim` ("pp", "tp", ...) for this rank, or None."""
        return self.mesh.get_group(dim) if self.has(dim) else None

    @property
    def tp_mesh(self) -> DeviceMesh:
        """The ranks one tensor-parallel layer is split over (plan.tp > 1)."""
        return self.mesh[TENSOR_PARALLEL]

    @property
    def pp_mesh(self) -> DeviceMesh:
        """The pipeline stages of this rank's model replica (plan.pp > 1)."""
        return self.mesh[self._only("pipeline")]

    @property
    def replica_group(self) -> dist.ProcessGroup | None:
        """The ranks DDP averages over (it runs when nothing is sharded: every loss rank
        holds the whole model, dp x cp), or None."""
        names = tuple(n for n in dims_with("loss") if self.has(n))
        if not names:
            return None
        return self.mesh.get_group(names[0]) if len(names) == 1 else self._flat(names).get_group()

    @property
    def data_mesh(self) -> DeviceMesh:
        """The mesh FSDP2 works over: the replicas, then the shards (fsdp x cp, as one
        dimension: torchtitan's dp_shard_cp), as HSDP; the shards alone without replicas."""
        replicas = tuple(n for n in dims_with("replica") if self.has(n))
        shards = tuple(n for n in dims_with("shard") if self.has(n))
        shard = shards[0] if len(shards) == 1 else self._flat(shards).mesh_dim_names[0]
        return self.mesh[(*replicas, shard)] if replicas else self.mesh[shard]

    @property
    def ep_mesh(self) -> DeviceMesh:
        """The ranks a layer's experts are spread over (plan.ep > 1): neighbouring loss
        ranks, as a 1-D mesh (the experts' DTensors live on it). Collective the first
        time: every rank asks."""
        return self._expert_groups()[0]

    @property
    def expert_replica_group(self) -> dist.ProcessGroup | None:
        """The ranks that hold the same experts (the loss ranks ep leaves), or None."""
        return self._expert_groups()[1]

    def _expert_groups(self) -> tuple[DeviceMesh, dist.ProcessGroup | None]:
        """The loss ranks of each pipeline stage and tensor-parallel place reshaped to
        (loss // ep, ep): "ep" spreads the experts, the other dimension replicates them.
        Groups of their own (new_subgroups_by_enumeration), never the default group a
        DeviceMesh reuses for a dimension over every rank: DDP's gradient all-reduces
        run on that one during backward, in an order that depends on each rank's graph,
        and the experts' all-to-alls in backward must not queue behind them (measured:
        ep=2 on 2 ranks hung in backward, one rank in DDP's all-reduce, one in ep's)."""
        if self._experts is None:
            names = list(self.mesh.mesh_dim_names or ())
            loss = [i for i, n in enumerate(names) if n in dims_with("loss")]
            ranks, losses, ep = self.mesh.mesh, self.grad_average_size, self.plan.ep
            # the loss dimensions are adjacent in MESH_ORDER: [outer | loss | inner]
            outer = ranks.shape[: loss[0]].numel() if loss else ranks.numel()
            grid = ranks.reshape(outer, losses // ep, ep, -1).movedim(3, 1)  # outer, inner, ..
            spread = grid.reshape(-1, ep).tolist()
            kept = grid.movedim(2, 3).reshape(-1, losses // ep).tolist()
            mine, _ = dist.new_subgroups_by_enumeration(spread)
            replicas, _ = dist.new_subgroups_by_enumeration(kept)
            group_ranks = next(r for r in spread if self.rank in r)
            mesh = DeviceMesh.from_group(
                mine, self.device.type, mesh=torch.tensor(group_ranks), mesh_dim_names=("ep",)
            )
            self._experts = (mesh, replicas if losses // ep > 1 else None)
        return self._experts

    @property
    def cp_mesh(self) -> DeviceMesh:
        """The ranks each sequence is cut over (plan.cp > 1)."""
        return self.mesh[self._only("sequence")]

    def _flat(self, names: tuple[str, ...]) -> DeviceMesh:
        """Adjacent mesh dimensions as one (torch's DeviceMesh._flatten, made once)."""
        flat = "_".join(names)
        if flat in (self.mesh.mesh_dim_names or ()):
            return self.mesh[flat]
        return self.mesh[names]._flatten(flat)

    @property
    def pipeline_groups(self) -> list[dist.ProcessGroup]:
        """Groups whose ranks hold disjoint parameters of the model: their gradient norms
        add up (the pipeline stages)."""
        name = self._only("pipeline")
        return [self.group(name)] if self.has(name) else []

    @staticmethod
    def _only(role: str) -> str:
        [name] = dims_with(role)
        return name

    def pipeline_ends_group(self) -> dist.ProcessGroup | None:
        """The group of each pipeline's first and last rank (a weight tied across the
        blocks, as an embedding and its head, lives on both): the pp group itself for
        pp=2. Collective for pp > 2 (it makes the groups): every rank calls it. None on
        a rank that is neither."""
        pp, stages = self.plan.pp, self._only("pipeline")
        if pp == 2:
            return self.group(stages)
        dims = list(self.mesh.mesh_dim_names)
        ranks = self.mesh.mesh.movedim(dims.index(stages), -1).reshape(-1, pp)
        pairs = [[int(row[0]), int(row[-1])] for row in ranks]
        group, _ = dist.new_subgroups_by_enumeration(pairs)
        return group

    @property
    def gradients_split(self) -> bool:
        """Whether no rank holds the whole gradient (tensor / pipeline / expert
        parallel, or sharded data parallel), so its norm needs collectives."""
        return self.plan.tp > 1 or self.plan.pp > 1 or self.plan.ep > 1 or self.plan.uses_fsdp

    def batch_sum(self, local: torch.Tensor) -> torch.Tensor:
        """The sum of a per-rank tensor (a loss, a count, a metric) over the ranks a loss
        is formed over: those the batch is split over, and the sequence chunks."""
        total = local.clone()
        for group in self.loss_groups:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return total

    def batch_max(self, local: torch.Tensor) -> None:
        """`local` made, in place, its largest value over the ranks the batch is split
        over (a question every one of them must answer alike)."""
        for group in self.batch_groups:
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)

    def batch_mean(self, local_mean: torch.Tensor) -> torch.Tensor:
        """The mean of a per-rank mean over the loss ranks (the same on every rank)."""
        ranks = self.grad_average_size
        if ranks == 1:
            return local_mean
        return self.batch_sum(local_mean) / ranks
