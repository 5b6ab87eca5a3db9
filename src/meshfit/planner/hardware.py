"""What the devices can do: the numbers the planner turns costs into seconds and bytes.

A `Hardware` is either a preset for a machine we may not have (common GPUs and their
usual nodes), numbers given by the user, or this machine's own (`this_machine()`), from
its device properties and, on request, a short probe (`measure()`: matrix-product
FLOP/s at the model's width, and the all-reduce bandwidth between local processes).

Where the presets come from (each figure is a vendor specification unless it says
"measured"; bandwidths are per device and per direction):

- dense bf16 matmul peak: A100 312 TFLOP/s, H100 SXM and H200 989 TFLOP/s;
- sustained rate of a whole training step (matrix products, and the norms, activations
  and attention between them): 0.564 of the peak compiled, 0.425 eager, *measured* on a
  lent H100 (BENCHMARKS.md: meshfit's 405M GPT, bf16, batch 16: 56.4% MFU with
  compile=True, 42.5% without; a bare bf16 matmul reached 0.80 there). A100 and H200
  are assumed to reach the same fractions (not measured here);
- memory: A100 40/80 GB, H100 80 GB, H200 141 GB; HBM bandwidth 1.56/2.04, 3.35, 4.8 TB/s;
- inside a node (NVLink): all-reduce bus bandwidth 230 GB/s on A100 and 360 GB/s on
  H100/H200 (typical nccl-tests results on 8-GPU nodes: 75-80% of the link's 300/450 GB/s
  per direction; assumed, not measured here);
- between nodes: one 200 Gb/s (A100 nodes, HDR) or 400 Gb/s (H100/H200, NDR) InfiniBand
  adapter per GPU, 90% usable: 22.5 / 45 GB/s.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass

import torch

from meshfit.errors import MeshfitError

GIB = 1024**3


@dataclass(frozen=True)
class Hardware:
    """One kind of device, and how many of them sit in a node and how they talk.

    matmul_flops: FLOP/s a training step sustains (its matrix products' FLOPs over its
        whole time), by precision ("bf16", "fp16", "fp32"); peak_flops: the
        specification's (the MFU denominator).
    device_memory: bytes one device holds for training.
    memory_bandwidth: bytes/s of device memory (the optimizer step is bound by it).
    intra_node_bandwidth / inter_node_bandwidth: bytes/s per device of an all-reduce or
        point-to-point transfer inside a node / between nodes.
    latency: seconds of fixed cost per collective.
    eager_efficiency: the share of `matmul_flops` a step reaches without torch.compile
        (meshfit's default): the unfused norms and activations cost more time.
    op_overhead: seconds of fixed cost per operator (Python, dispatch, kernel launch);
        a GPU runs it ahead of the kernels (`launch_ahead`), a CPU worker in line.
    dtensor_overhead: seconds a tensor-parallel layer adds per forward and backward
        (DTensor's dispatch in Python around the local matmul).
    """

    name: str
    device_memory: float
    matmul_flops: dict[str, float]
    peak_flops: dict[str, float]
    memory_bandwidth: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    devices_per_node: int = 8
    nodes: int = 1
    latency: float = 20e-6
    eager_efficiency: float = 1.0
    op_overhead: float = 10e-6
    launch_ahead: bool = True
    dtensor_overhead: float = 300e-6
    separate_host_memory: bool = True  # False on CPU workers: offload frees nothing
    source: str = "preset"

    @property
    def world_size(self) -> int:
        return self.devices_per_node * self.nodes

    def flops(self, precision: str, compiled: bool = False) -> float:
        if precision == "fp8":  # planned at the bf16 rate (its float8 speed-up unmeasured)
            precision = "bf16"
        rate = self.matmul_flops.get(precision) or self.matmul_flops["fp32"]
        return rate if compiled else rate * self.eager_efficiency

    def with_nodes(self, nodes: int, devices_per_node: int | None = None) -> Hardware:
        """The same devices, `nodes` nodes of `devices_per_node` (default: the preset's)."""
        return dataclasses.replace(
            self, nodes=nodes, devices_per_node=devices_per_node or self.devices_per_node
        )

    def group_bandwidth(self, span: int, stride: int) -> float:
        """Bandwidth of a group of ranks `stride` apart that spans `span` consecutive
        ranks: inside a node when the whole span fits in one."""
        if span <= self.devices_per_node and stride < self.devices_per_node:
            return self.intra_node_bandwidth
        return self.inter_node_bandwidth


def _gpu(name: str, memory_gb: float, bf16: float, fp32: float, hbm: float, nvlink: float,
         ib: float) -> Hardware:  # fmt: skip
    achieved = 0.564  # a whole step's share of the peak, compiled, measured on H100
    eager = 0.425 / 0.564  # the same without compile: see the module doc
    return Hardware(
        name=name,
        device_memory=memory_gb * 1e9,
        matmul_flops={"bf16": bf16 * achieved, "fp16": bf16 * achieved, "fp32": fp32 * achieved},
        peak_flops={"bf16": bf16, "fp16": bf16, "fp32": fp32},
        memory_bandwidth=hbm,
        intra_node_bandwidth=nvlink,
        inter_node_bandwidth=ib,
        eager_efficiency=eager,
    )


# fp32 without TF32 (torch's default for float32 matmuls): 19.5 / 67 TFLOP/s.
PRESETS: dict[str, Hardware] = {
    "a100-40gb": _gpu("A100 40GB SXM", 40, 312e12, 19.5e12, 1.555e12, 230e9, 22.5e9),
    "a100-80gb": _gpu("A100 80GB SXM", 80, 312e12, 19.5e12, 2.039e12, 230e9, 22.5e9),
    "h100": _gpu("H100 80GB SXM", 80, 989e12, 67e12, 3.35e12, 360e9, 45e9),
    "h200": _gpu("H200 141GB SXM", 141, 989e12, 67e12, 4.8e12, 360e9, 45e9),
}
ALIASES = {"a100": "a100-80gb", "h100-80gb": "h100", "h200-141gb": "h200"}


def hardware(
    name: str | Hardware | None = None, *, nodes: int = 1, devices_per_node: int | None = None
) -> Hardware:
    """A preset by name ("a100-40gb", "a100-80gb", "h100", "h200"), "cpu" or None for
    this machine (`this_machine`), or a Hardware as given; on `nodes` nodes."""
    if isinstance(name, Hardware):
        base = name
    elif name is None or name in ("cpu", "here", "this"):
        base = this_machine(devices_per_node or 1)
    else:
        key = ALIASES.get(name.lower(), name.lower())
        if key not in PRESETS:
            raise MeshfitError(
                f"unknown hardware {name!r}; known: {', '.join(PRESETS)}, 'cpu', or give "
                f"mf.planner.Hardware(...) with your own numbers"
            )
        base = PRESETS[key]
    if nodes < 1 or (devices_per_node is not None and devices_per_node < 1):
        raise MeshfitError(
            f"nodes and devices per node must be >= 1, not {nodes}, {devices_per_node}"
        )
    return base.with_nodes(nodes, devices_per_node)


def this_machine(processes: int = 1) -> Hardware:
    """This machine's devices, from their properties, the same on every rank (a plan
    chosen from it must not differ between ranks): a GPU that matches a preset is the
    preset; otherwise the CPU, shared by `processes` one-thread workers, with nominal
    rates (use `measure()` for measured ones)."""
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        for key, preset in PRESETS.items():
            family = key.split("-")[0].upper()
            if family in props.name.upper():
                return dataclasses.replace(
                    preset,
                    device_memory=float(props.total_memory),
                    devices_per_node=torch.cuda.device_count(),
                    source=f"preset for {props.name}",
                )
        raise MeshfitError(
            f"meshfit has no numbers for {props.name}: give plan_search(hardware=...) a "
            f"preset that is close ({', '.join(PRESETS)}) or mf.planner.Hardware(...)"
        )
    memory = _host_memory() / max(processes, 1)
    # Nominal one-core rates, the order of a current server core (fp32 matmul with AVX2
    # FMA ~50 GFLOP/s; memory ~10 GB/s per core; gloo over loopback ~1 GB/s).
    return Hardware(
        name="CPU",
        device_memory=memory,
        matmul_flops={"fp32": 50e9, "bf16": 25e9},
        peak_flops={"fp32": 50e9, "bf16": 25e9},
        memory_bandwidth=10e9,
        intra_node_bandwidth=1e9,
        inter_node_bandwidth=1e9,
        devices_per_node=max(processes, 1),
        latency=100e-6,
        op_overhead=15e-6,
        launch_ahead=False,
        dtensor_overhead=1e-3,
        separate_host_memory=False,
        source="nominal CPU rates",
    )


def _host_memory() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def measure_matmul_flops(width: int, precision: str = "fp32", seconds: float = 0.5) -> float:
    """Achieved FLOP/s of a (4*width x width) @ (width x width) product on this rank's
    device, the shape of a transformer's projections."""
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    a = torch.randn(4 * width, width, device=device, dtype=dtype)
    b = torch.randn(width, width, device=device, dtype=dtype)
    a @ b  # warm-up
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        count += 1
        if device.type == "cuda" and count % 16 == 0:
            torch.cuda.synchronize()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 2 * 4 * width**3 * count / (time.perf_counter() - start)


def measure_op_overhead(repeats: int = 2000) -> float:
    """Seconds one small operator costs on this rank (forward and autograd bookkeeping)."""
    x = torch.zeros(8, requires_grad=True)
    start = time.perf_counter()
    for _ in range(repeats):
        y = x * 1.0
    del y
    return (time.perf_counter() - start) / repeats


def measure_dtensor_overhead(repeats: int = 50) -> float | None:
    """Seconds a column- plus a row-parallel Linear pair adds per forward and backward
    over plain Linears, per layer, on a one-process mesh; None where a process group
    already runs (the probe needs its own)."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    if dist.is_initialized():
        return None
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        x = torch.randn(2, 8, 16)

        def pair() -> nn.Module:
            return nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16))

        def timed(model: nn.Module) -> float:
            for _ in range(3):
                model(x).sum().backward()
            start = time.perf_counter()
            for _ in range(repeats):
                model(x).sum().backward()
            return (time.perf_counter() - start) / repeats

        split = parallelize_module(pair(), mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
        return max(timed(split) - timed(pair()), 0.0) / 2
    finally:
        dist.destroy_process_group()


def _bandwidth_worker(nbytes: int, repeats: int) -> tuple[float, float]:
    """On every worker: (all-reduce bus bandwidth, point-to-point bandwidth) in bytes/s,
    rank 0's timing of `repeats` collectives on `nbytes` after a warm-up."""
    import torch.distributed as dist

    from meshfit.launch.process_group import init_distributed

    device = init_distributed()
    world = dist.get_world_size()
    x = torch.zeros(nbytes // 4, device=device)
    dist.all_reduce(x)  # warm-up: connections, buffers

    def timed(fn) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        return (time.perf_counter() - start) / repeats

    reduce = timed(lambda: dist.all_reduce(x))
    rank = dist.get_rank()

    def exchange() -> None:  # ranks 0 and 1 send to each other in turn
        if rank == 0:
            dist.send(x, 1)
            dist.recv(x, 1)
        elif rank == 1:
            dist.recv(x, 0)
            dist.send(x, 0)

    p2p = timed(exchange) / 2
    # An all-reduce moves 2 (n - 1) / n of its bytes over each rank's link (ring).
    return 2 * (world - 1) / world * nbytes / reduce, nbytes / p2p


def measure_network(
    nproc: int = 2, nbytes: int = 8 * 2**20, repeats: int = 5
) -> tuple[float, float]:
    """All-reduce bus bandwidth and point-to-point bandwidth (bytes/s) between `nproc`
    local workers started for the probe (gloo on CPU, NCCL on GPUs): a few seconds."""
    from meshfit.launch import launch

    return launch(_bandwidth_worker, nproc=nproc, args=(nbytes, repeats))


def measure(width: int = 512, processes: int = 1, network: bool = False) -> Hardware:
    """This machine with its matrix-product rate measured at `width` (fp32; bf16 too on
    a GPU), its cost per tensor-parallel layer and, on a CPU, per operator; with
    `network`, the all-reduce bandwidth between local workers (`measure_network`). Rates differ between runs: plan on
    every rank from the same numbers (measure on one and pass the Hardware on)."""
    base = this_machine(processes)
    if not torch.cuda.is_available():
        base = dataclasses.replace(base, op_overhead=measure_op_overhead())
    dtensor = measure_dtensor_overhead()
    if dtensor is not None:
        base = dataclasses.replace(base, dtensor_overhead=dtensor)
    rates = {"fp32": measure_matmul_flops(width, "fp32")}
    if torch.cuda.is_available():
        rates["bf16"] = rates["fp16"] = measure_matmul_flops(width, "bf16")
    else:
        rates["bf16"] = rates["fp16"] = rates["fp32"] / 2
    base = dataclasses.replace(
        base, matmul_flops=rates, source=f"{base.source}; matmul measured at width {width}"
    )
    if network:  # inside one machine: the all-reduce's bandwidth is the node's
        reduce, _ = measure_network(max(processes, 2))
        base = dataclasses.replace(
            base, intra_node_bandwidth=reduce, source=f"{base.source}, all-reduce measured"
        )
    return base
