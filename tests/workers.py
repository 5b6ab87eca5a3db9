"""Functions the multi-process tests run on workers (importable, so spawn can find them).

Every run builds its model and data from fixed seeds, so the same spec gives the same
training run in one process or in many.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import io
import os
import signal
import sys
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

import meshfit as mf
from meshfit.models import GPT, GPTConfig, next_token_loss

# bias=False: a key-projection bias gets an exactly-zero gradient (softmax ignores it), so
# Adam would turn float noise in it into full-size updates and no comparison means much.
TINY_GPT = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16, bias=False)
# Enough blocks and heads for pp=4, interleaved pp=2 (4 stages) and tp=4.
GPT4 = GPTConfig(vocab_size=32, block_size=8, n_layer=4, n_head=4, n_embd=16, bias=False)


def build(kind: str, dtype: str = "float64") -> tuple[torch.nn.Module, object]:
    """A fresh model of `kind` from a fixed seed, in `dtype` (float64 by default: the
    equivalence tests compare in float64, see helpers.py), and its loss function."""
    model, loss_fn = _build(kind)
    return model.to(getattr(torch, dtype)), loss_fn


def _build(kind: str) -> tuple[torch.nn.Module, object]:
    torch.manual_seed(1234)  # the same initial weights in every dtype
    if kind == "mlp":
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 32),
            torch.nn.Tanh(),
            torch.nn.Linear(32, 32),
            torch.nn.Tanh(),
            torch.nn.Linear(32, 5),
        )
        return model, F.cross_entropy
    if kind == "deep_mlp":  # enough Linears for every one of 4 pipeline stages
        layers = [torch.nn.Linear(8, 32), torch.nn.Tanh()]
        for _ in range(3):
            layers += [torch.nn.Linear(32, 32), torch.nn.Tanh()]
        return torch.nn.Sequential(*layers, torch.nn.Linear(32, 5)), F.cross_entropy
    if kind in ("gpt", "gpt_pattern"):
        return GPT(TINY_GPT), next_token_loss
    if kind == "gpt4":
        return GPT(GPT4), next_token_loss
    if kind == "gpt4_dropout":  # random numbers every step, on every stage
        return GPT(dataclasses.replace(GPT4, dropout=0.1)), next_token_loss
    if kind == "llama":
        return hf_llama(), next_token_loss_of_output
    if kind == "llama10":  # more blocks per pp stage than torch.compile's recompile limit
        return hf_llama(num_hidden_layers=20), next_token_loss_of_output
    if kind == "root_param":
        return RootScaled(), F.cross_entropy
    if kind == "column_major":  # blocks whose outputs are not contiguous
        blocks = [ColumnMajorBlock() for _ in range(4)]
        return torch.nn.Sequential(*blocks, torch.nn.Linear(8, 5)), F.cross_entropy
    if kind == "bn_cnn":  # BatchNorm: statistics over the batch
        return bn_cnn(), F.cross_entropy
    if kind == "titan":  # layers in a ModuleDict, and a larger stack that is not them
        return TitanStyle(), F.cross_entropy
    if kind == "two_stacks":  # a second stack of another kind, whose attention cannot split
        return TwoStacks(), next_token_loss
    if kind == "global_heads":
        return GlobalHeads(), next_token_loss
    if kind == "named_heads":
        return GlobalHeads(_NamedHeadsBlock), next_token_loss
    raise ValueError(kind)


class TitanBlock(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class TwoStacks(torch.nn.Module):
    """Three MLP blocks, then two blocks of nanoGPT's model.py (its attention cuts q|k|v at
    the whole width, so it cannot follow a tp split): two stacks of two kinds, as an
    encoder and a decoder of other types are (Whisper's)."""

    def __init__(self) -> None:
        super().__init__()
        from nanogpt import Block
        from nanogpt import GPTConfig as NanoConfig

        width = TINY_GPT.n_embd
        config = NanoConfig(block_size=8, vocab_size=32, n_layer=2, n_head=2, n_embd=width)
        config.bias = False
        self.embed = torch.nn.Embedding(TINY_GPT.vocab_size, width)
        self.first = torch.nn.ModuleList(TitanBlock(width) for _ in range(3))
        self.second = torch.nn.ModuleList(Block(config) for _ in range(2))
        self.head = torch.nn.Linear(width, TINY_GPT.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in [*self.first, *self.second]:
            x = block(x)
        return self.head(x)


class TitanStyle(torch.nn.Module):
    """Layers in a ModuleDict keyed "0".."3", as torchtitan keeps them, after a stem of
    six same-type modules (a larger stack, so meshfit's guess is the stem; the user
    names the layers with blocks="layers")."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(6))
        self.proj = torch.nn.Linear(8, 16)
        self.layers = torch.nn.ModuleDict({str(i): TitanBlock(16) for i in range(4)})
        self.head = torch.nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.stem:
            x = torch.tanh(layer(x))
        h = self.proj(x)
        for layer in self.layers.values():
            h = layer(h)
        return self.head(h)


def bn_cnn() -> torch.nn.Sequential:
    """A small CNN with BatchNorm after each convolution (2-D and 1-D), as vision code
    builds them."""
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8, momentum=None),  # cumulative running average
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(32, 16),
        nn.BatchNorm1d(16),
        nn.ReLU(),
        nn.Linear(16, 5),
    )


class _GlobalHeadsBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(16, 16) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (
            p(x).view(b, t, GlobalHeads.HEADS, -1).transpose(1, 2) for p in (self.q, self.k, self.v)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(y.transpose(1, 2).reshape(b, t, -1))


class _NamedHeadsBlock(_GlobalHeadsBlock):
    """The head count kept on the module under a name of its own, as diffusers'
    Attention keeps `heads`: tp must give each rank its local count."""

    def __init__(self) -> None:
        super().__init__()
        self.heads = 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (
            p(x).view(b, t, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(y.transpose(1, 2).reshape(b, t, -1))


class GlobalHeads(torch.nn.Module):
    """Attention that reshapes with a head count kept on its class, not on the module: a
    tp rank cannot be given its local count, so tp must refuse it."""

    HEADS = 2

    def __init__(self, block: type = _GlobalHeadsBlock) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(TINY_GPT.vocab_size, 16)
        self.blocks = torch.nn.ModuleList(block() for _ in range(2))
        self.head = torch.nn.Linear(16, TINY_GPT.vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class ColumnMajorBlock(torch.nn.Module):
    """A block whose output is laid out column-major (a transposed view, as a
    channels-last norm or a transposed projection leaves it): the same values, not
    contiguous."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x)).t().contiguous().t()


class RootScaled(torch.nn.Module):
    """A parameter on the model itself, used before the blocks (under fsdp x pp it lands
    in the root FSDP unit of the first stage), and a loop that computes between blocks
    (the tanh after each one), which a pipeline cut must keep on the stage before it."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, 8))
        sizes = [(8, 32), (32, 32), (32, 32), (32, 32)]
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in sizes)
        self.head = torch.nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * self.scale
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def make_batch(
    kind: str, batch: int, step: int, dtype: str = "float64"
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 + step)
    if kind in ("mlp", "deep_mlp", "root_param", "titan", "column_major"):
        inputs = torch.randn(batch, 8, generator=g).to(getattr(torch, dtype))
        return inputs, torch.randint(0, 5, (batch,), generator=g)
    if kind == "bn_cnn":
        images = (torch.randn(batch, 3, 6, 6, generator=g) * 2 + 1).to(getattr(torch, dtype))
        return images, torch.randint(0, 5, (batch,), generator=g)
    if kind == "gpt_pattern":  # learnable: counting mod the vocabulary in steps of 1-3
        start = torch.randint(0, TINY_GPT.vocab_size, (batch, 1), generator=g)
        stride = torch.randint(1, 4, (batch, 1), generator=g)
        tokens = (start + stride * torch.arange(TINY_GPT.block_size + 1)) % TINY_GPT.vocab_size
        return tokens[:, :-1], tokens[:, 1:]
    tokens = torch.randint(0, TINY_GPT.vocab_size, (batch, TINY_GPT.block_size + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def optimizer_factory(name: str):
    if name == "sgd":
        # Plain SGD keeps the gradient's scale in the update, so a wrongly averaged
        # gradient shows up in the weights (Adam would normalise it away).
        return lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


# What FSDP2 reduce-scatters gradients with (torch 2.13; reduce_scatter_tensor before).
REDUCE_SCATTER = (
    "reduce_scatter_single"
    if hasattr(torch.distributed, "reduce_scatter_single")
    else "reduce_scatter_tensor"
)


@contextlib.contextmanager
def count_calls(module: object, name: str):
    """Count calls to `module.name` inside the block; yields a one-element list."""
    original, count = getattr(module, name), [0]

    def counted(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    setattr(module, name, counted)
    try:
        yield count
    finally:
        setattr(module, name, original)


def scaled_gradient(loss_fn, scale: float):
    """loss_fn with the same value but `scale` times its gradient: a deliberately wrong
    gradient scale, for the negative controls."""

    def wrong(outputs, targets):
        loss = loss_fn(outputs, targets)
        return loss + (scale - 1.0) * (loss - loss.detach())

    return wrong


def engine_run(spec: dict) -> dict:
    """Train with engine.step on the global batch; return losses and final weights."""
    if spec.get("unsendable"):  # negative control: stages send what their blocks return
        from meshfit.parallel.pipeline import stage

        stage._sendable = lambda output: output
    dtype = spec.get("dtype", "float64")
    model, loss_fn = build(spec["model"], dtype)
    if "grad_scale" in spec:
        loss_fn = scaled_gradient(loss_fn, spec["grad_scale"])
    params = dict(model.named_parameters())
    for name, scale in spec.get("grad_hooks", {}).items():  # negative controls: one
        params[name].register_hook(lambda g, s=scale: g * s)  # tensor's gradient wrong
    compiled = spec.get("options", {}).get("compile", False)
    if compiled:  # a fresh cache per run: earlier runs' graphs count toward torch's limit
        torch._dynamo.reset()
        # a function past torch's recompile limit would run eagerly with only a log line
        torch._dynamo.config.fail_on_recompile_limit_hit = True
    graphs_before, frames_before = _compiled_graphs(), _compiled_frames()
    engine = mf.parallelize(
        model,
        spec.get("plan"),
        optimizer=optimizer_factory(spec.get("optimizer", "sgd")),
        loss_fn=loss_fn,
        grad_clip=spec.get("grad_clip"),
        **spec.get("options", {}),
    )
    losses = []
    for step in range(spec.get("steps", 4)):
        batch = make_batch(spec["model"], spec.get("batch", 16), step, dtype)
        with count_calls(torch.distributed, REDUCE_SCATTER) as reduce_scatters:
            losses.append(float(engine.step(batch)))
    eval_batch = make_batch(spec["model"], spec.get("batch", 16), 999, dtype)
    eval_loss = float(engine.evaluate(eval_batch))
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: no FSDP2 units
    fsdp_units = sum(isinstance(m, fsdp.FSDPModule) for m in model.modules()) if fsdp else 0
    buffer_bytes = sum(b.untyped_storage().nbytes() for b in model.buffers())
    stages = getattr(engine.runner, "stages", [])  # a pipeline's (torch's PipelineStages)
    return {
        "losses": losses,
        "eval": eval_loss,
        # micro-batch outputs the stages still hold after the evaluation (torch's cache
        # for a backward that an evaluation never runs)
        "kept_after_evaluate": _on_every_rank(sum(len(s.fwd_cache) for s in stages)),
        "state": engine.full_state_dict(),
        "rank": engine.rank,
        "fsdp_units": fsdp_units,
        "buffer_bytes": buffer_bytes,
        # {parameter: its local shape} where tensor parallel split one outside the blocks
        "split_outside": _split_outside_blocks(model),
        "tp_split": engine.tp_report and engine.tp_report.describe(),
        "float8_layers": _on_every_rank(
            sum(type(m).__name__ == "Float8Linear" for m in model.modules())
        )
        if "fp8" in str(spec.get("plan"))
        else None,
        "reduce_scatters_last_step": reduce_scatters[0],
        "compiled_graphs": _compiled_graphs() - graphs_before,
        # the frames torch.compile compiled, on every rank
        "compiled_frames": _on_every_rank(_compiled_frames()[1] - frames_before[1])
        if compiled
        else None,
    }


def _compiled_frames() -> list[int]:
    utils = sys.modules.get("torch._dynamo.utils")
    frames = utils.counters["frames"] if utils else {}
    return [frames.get("total", 0), frames.get("ok", 0)]


def _on_every_rank(value: object) -> list:
    """[value of rank 0, value of rank 1, ...] (mf.launch returns rank 0's result only)."""
    if not torch.distributed.is_initialized():
        return [value]
    values = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(values, value)
    return values


def _compiled_graphs() -> int:
    """Graphs torch.compile has made in this process (0 if dynamo was never loaded)."""
    utils = sys.modules.get("torch._dynamo.utils")
    return utils.counters["stats"]["unique_graphs"] if utils else 0


def dataset(kind: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return make_batch(kind, n, step=77)


def fit_run(spec: dict) -> dict:
    """Train with mf.fit; stop_after simulates a run cut short (it checkpoints there)."""
    model, loss_fn = build(spec["model"])
    if spec.get("loss") == "worst_sequence":
        loss_fn = worst_sequence_loss
    kwargs = dict(
        plan=spec.get("plan"),
        loss_fn=loss_fn,
        optimizer=optimizer_factory(spec.get("optimizer", "adamw")),
        batch_size=spec.get("batch", 8),
        max_steps=spec["steps"],
        checkpoint_dir=spec.get("checkpoint_dir"),
        checkpoint_every=spec.get("checkpoint_every"),
        log_every=spec.get("log_every", 2),
        progress=spec.get("progress", False),
        seed=3,
    )
    if spec.get("lr_scheduler"):
        kwargs["lr_scheduler"] = lambda opt: torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
    if spec.get("dropout"):
        model = torch.nn.Sequential(model, torch.nn.Dropout(0.2))
    if spec.get("busy_rank") == int(os.environ.get("RANK", "0")):
        _keep_busy()  # another job's load on this rank's core, all run long
    data = dataset(spec["model"], spec.get("samples", 64))
    history = mf.fit(model, data, **kwargs)
    state = history.engine.full_state_dict()
    return {
        "losses": history.losses,
        "steps": [r["step"] for r in history],
        "state": state,
        "planned": history.planned,
    }


def fit_runs(specs: list[dict]) -> list[dict]:
    return [fit_run(spec) for spec in specs]


def worst_sequence_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The batch's worst sequence (its mean token loss): couples the samples where
    meshfit cannot make it global (neither a mean nor a sum of theirs)."""
    tokens = F.cross_entropy(outputs.flatten(0, 1), targets.flatten(), reduction="none")
    return tokens.view(targets.shape).mean(1).max()


def _keep_busy() -> None:
    """A thread that spins for the rest of the process: this rank's work (and any timing
    it takes) runs slowed and unevenly, as beside another job."""
    import threading

    def spin() -> None:  # in bursts: the rank is slowed and uneven, not stalled
        while True:
            start = time.perf_counter()
            while time.perf_counter() - start < 0.003:
                sum(range(1_000))
            time.sleep(0.007)

    threading.Thread(target=spin, daemon=True).start()


def raise_on_rank(rank_to_fail: int) -> int:
    if int(os.environ["RANK"]) == rank_to_fail:
        raise KeyError(f"boom on {rank_to_fail}")
    return int(os.environ["RANK"])


def die_on_rank(rank_to_fail: int) -> int:
    if int(os.environ["RANK"]) == rank_to_fail:
        os.kill(os.getpid(), signal.SIGKILL)
    return 0


def hold(seconds: float) -> int:
    """Join the process group and hold it: a run whose sockets a test can look at."""
    from meshfit.launch.process_group import init_distributed

    init_distributed()
    torch.distributed.barrier()
    time.sleep(seconds)
    torch.distributed.barrier()
    return 0


def fit_killed_once(
    checkpoint_dir: str,
    kill_at: int | None,
    stall_at: int | None = None,
    stall_marker: str | None = None,
) -> dict:
    """fit with checkpoints; with kill_at, rank 1 SIGKILLs itself after that step on the
    first attempt (mf.launch(max_restarts=1) restarts the group, fit resumes). With
    stall_at, the last rank writes `stall_marker` and waits after that step instead,
    once, for a test to kill its whole host (a restarted host finds the marker and
    trains on: its own agent counts its attempts from 0 again)."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def kill_once(step: int, engine: mf.Engine) -> None:
        if step == kill_at and attempt == 0 and engine.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        last = engine.rank == engine.world_size - 1
        if stall_at == step and last and not os.path.exists(stall_marker):
            with open(stall_marker, "w") as f:
                f.write(str(step))
            time.sleep(600)

    model, loss_fn = build("mlp")
    history = mf.fit(
        model,
        dataset("mlp", 48),
        loss_fn=loss_fn,
        optimizer=optimizer_factory("adamw"),
        batch_size=8,
        max_steps=8,
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=2,
        progress=False,
        callbacks=[kill_once],
    )
    return {
        "attempt": attempt,
        "losses": history.losses,
        "state": model.state_dict(),
        "rank": history.engine.rank,
    }


def _split_outside_blocks(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    from torch.distributed.tensor import DTensor

    from meshfit.parallel.blocks import find_blocks

    try:
        stack = find_blocks(model)
    except mf.MeshfitError:
        return {}
    inside = tuple(f"{stack.qualified(key)}." for key in stack.keys)
    return {
        name: tuple(p.to_local().shape)
        for name, p in model.named_parameters()
        if isinstance(p, DTensor) and not name.startswith(inside)
    }


def world_info() -> dict:
    return {
        "rank": int(os.environ["RANK"]),
        "world": int(os.environ["WORLD_SIZE"]),
        "threads": torch.get_num_threads(),
    }


def launch_facts(leak: str) -> dict:
    """What a launched worker starts with (tests/test_launch.py: nothing of an earlier
    launch, this process's environment and streams, fresh random states, the heavy
    modules already imported), then it leaves `leak` behind in meshfit's module state
    and the default process group, which the next launch must not see."""
    import random

    import numpy
    import torch.distributed as dist

    import meshfit
    from meshfit.launch import watchdog

    facts = {
        "rank": int(os.environ["RANK"]),
        "pid": os.getpid(),
        "server": os.getppid(),
        "env": os.environ.get("MESHFIT_TEST_MARK"),
        "gone": os.environ.get("MESHFIT_TEST_GONE"),
        "cwd": os.getcwd(),
        "group_at_start": dist.is_initialized(),
        "left_behind": getattr(meshfit, "_left_behind", None),
        "random": random.random(),
        "numpy": float(numpy.random.rand()),
        "torch_seed": torch.initial_seed(),
        "torch_rand": float(torch.rand(())),
        "cuda_initialized": torch.cuda.is_initialized(),
        "preloaded": "transformers" in sys.modules,
        # how long the watchdog takes this rank to have been in start-up (its clock)
        "setup_for": time.monotonic() - watchdog._since,
        "phase": watchdog._current.kind,
    }
    print(f"worker {facts['rank']} writes to the launch's stdout", flush=True)
    meshfit._left_behind = leak
    dist.init_process_group("gloo")
    return _on_every_rank(facts)


def many_engine_runs(specs: list[dict]) -> list[dict]:
    """Several runs in one set of workers (saves process start-up in the tests)."""
    return [engine_run(spec) for spec in specs]


def save_after_training(spec: dict, path: str) -> dict:
    """Train with engine.step under spec's plan, save to `path`, return the weights."""
    dtype = spec.get("dtype", "float64")
    model, loss_fn = build(spec["model"], dtype)
    engine = mf.parallelize(
        model, spec.get("plan"), optimizer=optimizer_factory("sgd"), loss_fn=loss_fn
    )
    for step in range(spec.get("steps", 4)):
        engine.step(make_batch(spec["model"], spec.get("batch", 16), step, dtype))
    engine.save(path)
    return {"state": engine.full_state_dict()}


def save_runs(specs: list[dict], paths: list[str]) -> list[dict]:
    return [save_after_training(spec, path) for spec, path in zip(specs, paths, strict=True)]


def skewed_sequential() -> torch.nn.Sequential:
    """Six blocks, the first several times as costly as each of the others."""
    torch.manual_seed(0)
    heavy = [
        torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 64))
    ]
    light = [
        torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64))
        for _ in range(5)
    ]
    return torch.nn.Sequential(*heavy, *light)


def balance_run(example: str) -> dict:
    """Cut the skewed model over pp=2; report cut points and stage costs. `example`:
    "given" (example_inputs), "first batch" (none: the engine builds on its first
    batch), "none" (none, and the runner read before any batch)."""
    model = skewed_sequential()
    x = torch.randn(256, 64)
    engine = mf.parallelize(
        model,
        "pp=2",
        loss_fn=F.mse_loss,
        example_inputs=x[:64] if example == "given" else None,
    )
    if example == "none":
        engine.runner  # noqa: B018 - built now, with no example to count FLOPs on
    losses = [float(engine.step((x, torch.zeros(256, 64)))) for _ in range(2)]
    pipe = engine.runner
    return {
        "starts": pipe.starts,
        "costs": pipe.costs,
        "describe": pipe.describe(),
        "losses": losses,
    }


def many_balance_runs(examples: list[str]) -> list[dict]:
    return [balance_run(example) for example in examples]


def llama_config(**overrides):
    """A tiny Hugging Face Llama config (grouped-query attention, rotary positions), the
    library's defaults otherwise (untied LM head, as LlamaConfig has it)."""
    from transformers import LlamaConfig

    fields = dict(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
    )
    config = LlamaConfig(**{**fields, **overrides})
    config._attn_implementation = "sdpa"
    return config


def hf_llama(**overrides):
    """A LlamaForCausalLM as the library builds it from a config (no download); called
    as model(input_ids), it returns its own CausalLMOutputWithPast."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(1234)
    return LlamaForCausalLM(llama_config(**overrides))


def next_token_loss_of_output(outputs, targets: torch.Tensor) -> torch.Tensor:
    """next_token_loss on a model's output object (its .logits)."""
    return next_token_loss(mf.losses.logits_of(outputs), targets)


def memory_run(plan: str) -> dict:
    """Model-state bytes on this rank after two AdamW steps of the GPT under `plan`."""
    model, loss_fn = build("gpt4")
    engine = mf.parallelize(model, plan, optimizer=optimizer_factory("adamw"), loss_fn=loss_fn)
    engine.memory_report()  # start measuring gradients at the optimizer step
    for step in range(2):
        engine.step(make_batch("gpt4", 16, step))
    return engine.memory_report()


def gathered_after_forward(plan: str) -> dict[str, bool]:
    """After a forward under `plan` (FSDP), which units' parameters are still gathered,
    whole tensors rather than this rank's DTensor shards: first / last block, root."""
    from torch.distributed.tensor import DTensor

    model, loss_fn = build("gpt4")
    engine = mf.parallelize(model, plan, optimizer=optimizer_factory("sgd"), loss_fn=loss_fn)
    inputs, targets = make_batch("gpt4", 16, 0)
    loss_fn(engine.parallel_model(inputs), targets).backward()  # a first step sets FSDP up
    engine.parallel_model(inputs)
    units = {"first block": model.blocks[0], "last block": model.blocks[-1], "root": model.tok_emb}
    return {name: not isinstance(next(unit.parameters()), DTensor) for name, unit in units.items()}


def offload_memory_run(spec: dict) -> dict:
    """engine_run under an offload plan, plus where the model state lives between steps:
    the devices of parameters, gradients and optimizer state, and the GPU bytes in use."""
    model, loss_fn = build(spec["model"])
    engine = mf.parallelize(
        model,
        spec["plan"],
        loss_fn=loss_fn,
        grad_clip=spec.get("grad_clip"),
        optimizer=optimizer_factory(spec.get("optimizer", "sgd")),
    )
    engine.memory_report()  # measure gradients at the optimizer step
    losses = [
        float(engine.step(make_batch(spec["model"], spec.get("batch", 16), step)))
        for step in range(spec.get("steps", 4))
    ]
    torch.cuda.synchronize()
    tensors = [
        p.data.to_local() if hasattr(p.data, "to_local") else p.data
        for p in engine.parallel_model.parameters()
    ]
    tensors += [
        v
        for s in engine.optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.ndim > 0
    ]
    report = engine.memory_report()
    with_workspaces = torch.cuda.memory_allocated()
    # cuBLAS keeps its workspaces in torch's allocator, a fixed size per handle whatever
    # the model (64 MiB on an H200 with torch 2.11): not model state
    torch._C._cuda_clearCublasWorkspaces()
    return {
        "losses": losses,
        "state": engine.full_state_dict(),
        "state_devices": sorted({t.device.type for t in tensors}),
        "state_bytes": report["parameters"] + report["optimizer"],
        "gpu_bytes_between_steps": torch.cuda.memory_allocated(),
        "gpu_bytes_with_cublas_workspaces": with_workspaces,
    }


def fsdp_checks(specs: list[dict], plan: str) -> dict:
    """Equivalence runs, the model-state bytes and the resharding behaviour, in one set
    of workers (process start-up is most of a small test's time)."""
    return {
        "runs": many_engine_runs(specs),
        "memory": memory_run(plan),
        "gathered": {
            r: gathered_after_forward(f"{plan},reshard_after_forward={r}") for r in (True, False)
        },
    }


def continue_run(spec: dict, path: str, first_step: int) -> dict:
    """Load the checkpoint at `path` under spec's plan, train on from `first_step`."""
    model, loss_fn = build(spec["model"])
    engine = mf.parallelize(
        model, spec.get("plan"), optimizer=optimizer_factory("sgd"), loss_fn=loss_fn
    )
    engine.load(path)
    losses = [
        float(engine.step(make_batch(spec["model"], spec.get("batch", 16), step)))
        for step in range(first_step, first_step + spec.get("steps", 4))
    ]
    return {"losses": losses, "state": engine.full_state_dict()}


def activation_costs(plan: str) -> tuple[int, int]:
    """For one step of the gpt4 model under `plan`: bytes autograd keeps outside the
    recomputed regions, and matrix products run during backward (recomputation adds the
    forward's again; selective recomputation must not)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountMatmuls(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (
                torch.ops.aten.mm.default,
                torch.ops.aten.addmm.default,
                torch.ops.aten.bmm.default,
            ):
                CountMatmuls.count += 1
            return func(*args, **(kwargs or {}))

    model, loss_fn = build("gpt4")
    engine = mf.parallelize(model, plan, optimizer=optimizer_factory("sgd"), loss_fn=loss_fn)
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    x, y = make_batch("gpt4", 16, 0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn(engine.parallel_model(x), y)
    with CountMatmuls():
        loss.backward()
    return total[0], CountMatmuls.count


# ---- language-model batches (issue 21) -----------------------------------------------
LM_VOCAB, LM_LEN = 32, 12


def build_lm(kind: str, dtype: str = "float64") -> torch.nn.Module:
    """A small language model from a real library's config (no download), in `dtype`."""
    torch.manual_seed(1234)
    if kind == "seq_lm":  # your own: an nn.Sequential over token ids
        width = 16
        model = torch.nn.Sequential(
            torch.nn.Embedding(LM_VOCAB, width),
            torch.nn.Linear(width, 32),
            torch.nn.Tanh(),
            torch.nn.Linear(32, width),
            torch.nn.Tanh(),
            torch.nn.Linear(width, LM_VOCAB),
        )
    elif kind == "llama":
        model = hf_llama()
    elif kind == "llama_mqa":  # multi-query attention: one key/value head for all
        model = hf_llama(num_key_value_heads=1)
    elif kind in ("gpt2", "gpt2_4"):
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            vocab_size=LM_VOCAB,
            n_positions=LM_LEN,
            n_embd=16,
            n_layer=4 if kind == "gpt2_4" else 2,
            n_head=2,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        model = GPT2LMHeadModel(config)
    elif kind == "bert":  # an encoder: query/key/value and three `dense` layers
        from transformers import BertConfig, BertForMaskedLM

        config = BertConfig(
            vocab_size=LM_VOCAB,
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=LM_LEN,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        model = BertForMaskedLM(config)
    elif kind == "neox":  # q, k, v fused per head: [q_h, k_h, v_h] for each head h
        from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

        config = GPTNeoXConfig(
            vocab_size=LM_VOCAB,
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=LM_LEN,
            hidden_dropout=0.0,
            attention_dropout=0.0,
        )
        model = GPTNeoXForCausalLM(config)
    elif kind == "olmo2":  # q_norm / k_norm over all heads' width at once
        from transformers import Olmo2Config, Olmo2ForCausalLM

        config = Olmo2Config(
            vocab_size=LM_VOCAB,
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=LM_LEN,
        )
        model = Olmo2ForCausalLM(config)
    elif kind == "recurrent_gemma":  # keeps its recurrent state on a module after a forward
        from transformers import RecurrentGemmaConfig, RecurrentGemmaForCausalLM

        config = RecurrentGemmaConfig(
            vocab_size=LM_VOCAB,
            hidden_size=16,
            lru_width=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            use_cache=False,  # with its cache transformers' own forward fails (5.24)
        )
        model = RecurrentGemmaForCausalLM(config)
    elif kind in ("qwen3", "qwen3_moe", "qwen3_mqa"):  # per-head q_norm / k_norm
        from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

        fields = dict(
            vocab_size=LM_VOCAB,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1 if kind == "qwen3_mqa" else 2,
            head_dim=4,
            max_position_embeddings=LM_LEN,
        )
        if kind in ("qwen3", "qwen3_mqa"):
            model = Qwen3ForCausalLM(Qwen3Config(**fields))
        else:
            config = Qwen3MoeConfig(
                **fields, moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2
            )
            model = Qwen3MoeForCausalLM(config)
            dtype = "float32"  # its experts run on torch._grouped_mm, which takes no float64
    elif kind == "t5":
        from transformers import T5Config, T5ForConditionalGeneration

        config = T5Config(
            vocab_size=LM_VOCAB,
            d_model=16,
            d_kv=4,
            d_ff=32,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=4,
            dropout_rate=0.0,
            decoder_start_token_id=0,
            pad_token_id=0,
        )
        model = T5ForConditionalGeneration(config)
    else:
        raise ValueError(kind)
    return model.to(getattr(torch, dtype))


def sft_batch(kind: str, batch: int, step: int) -> object:
    """An SFT-like batch as a collator yields it: a prompt (masked out of the loss with
    -100), an answer of its own length, right padding; each model family's form."""
    g = torch.Generator().manual_seed(20_000 + step)
    ids = torch.zeros(batch, LM_LEN, dtype=torch.long)  # pad id 0
    mask = torch.zeros(batch, LM_LEN, dtype=torch.long)
    labels = torch.full((batch, LM_LEN), -100)
    for i in range(batch):
        prompt = int(torch.randint(2, 6, (), generator=g))
        answer = int(torch.randint(1, LM_LEN - prompt + 1, (), generator=g))
        n = prompt + answer
        ids[i, :n] = torch.randint(1, LM_VOCAB, (n,), generator=g)
        mask[i, :n] = 1
        labels[i, prompt:n] = ids[i, prompt:n]
    if kind == "seq_lm":  # next-token targets, already shifted
        targets = torch.full_like(labels, -100)
        targets[:, :-1] = labels[:, 1:]
        return ids, targets
    if kind in ("llama", "qwen3", "qwen3_moe", "llama_mqa", "qwen3_mqa"):
        return {"input_ids": ids, "attention_mask": mask}, labels
    if kind.startswith("gpt2") or kind in (
        "bert",
        "neox",
        "olmo2",
        "recurrent_gemma",
    ):  # labels in it
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
    if kind == "t5":  # the answer is the decoder's target
        decoder_ids = torch.zeros_like(ids)
        decoder_ids[:, 1:] = labels[:, :-1].clamp_min(0)
        return {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": decoder_ids}, labels
    raise ValueError(kind)


def lm_loss(kind: str, mean: bool = False, summed: bool = False):
    """How each family is trained: the token-weighted pair, or the model's own loss.
    `mean=True`: the mean over the real targets instead; `summed=True`: their sum."""
    if kind.startswith("gpt2") or kind in ("bert", "neox", "olmo2", "recurrent_gemma"):
        return "model"
    shifted = ("llama", "qwen3", "qwen3_moe", "llama_mqa", "qwen3_mqa")
    loss = mf.losses.cross_entropy(shift=kind in shifted)
    if summed:

        def token_sum(outputs, targets):  # reads .logits, as a user's loss does
            return loss(outputs.logits, targets)[0]

        return token_sum
    if not mean:
        return loss

    def per_part_mean(outputs, targets):
        total, count = loss(outputs, targets)
        return total / count

    return per_part_mean


def _reads_the_models_loss(outputs, targets):
    """A user's loss_fn that returns the model's own (labels in its inputs): its mean over
    the labels it shifts, already reduced when the loss_fn sees it."""
    return outputs.loss


def _mean_ignoring_the_pad_id(outputs, targets):
    """A script's causal-LM loss over labels padded with the pad id (0): shifted, and
    ignore_index=0, a mean over the tokens that are not padding."""
    logits = outputs.logits[:, :-1].flatten(0, 1)
    return F.cross_entropy(logits, targets[:, 1:].flatten(), ignore_index=0)


def _lm_batch(spec: dict, step: int) -> object:
    """sft_batch for `spec`; "collated": the labels DataCollatorForLanguageModeling
    (mlm=False) yields instead, the ids with -100 at the padding only (each row's first
    label real), for a model given its labels beside the batch (Llama's kinds)."""
    batch = sft_batch(spec["model"], spec.get("batch", 8), step)
    if spec.get("pad_id"):  # the ids as labels, padded with the pad id (0), not -100
        inputs = batch[0]
        if spec.get("full_rows"):  # the second half's rows unpadded: dp's rank 1 sees none
            rows = slice(len(inputs["input_ids"]) // 2, None)
            ids = inputs["input_ids"].clone()
            g = torch.Generator().manual_seed(30_000 + step)
            ids[rows] = torch.randint(1, LM_VOCAB, ids[rows].shape, generator=g)
            mask = torch.ones_like(inputs["attention_mask"])
            inputs = {"input_ids": ids, "attention_mask": mask.masked_fill(ids == 0, 0)}
        return inputs, inputs["input_ids"]
    if not spec.get("collated"):
        return batch
    inputs, _ = batch
    labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
    if spec.get("reads_loss"):  # the labels in the inputs too: the model computes its loss
        return {**inputs, "labels": labels}, labels
    return inputs, labels


def _lm_loss_fn(spec: dict):
    if spec.get("reads_loss"):
        return _reads_the_models_loss
    if spec.get("pad_id"):
        return _mean_ignoring_the_pad_id
    return lm_loss(spec["model"], spec.get("mean", False), spec.get("sum", False))


def _lm_fit_run(spec: dict) -> dict:
    """lm_run through mf.fit: the same batches as a dataset of one dict a sample (the
    labels a column), in order; fit builds the split on the dataset's first samples."""
    batches = [_lm_batch(spec, step) for step in range(spec.get("steps", 3))]
    data = [
        {**{k: v[i] for k, v in inputs.items()}, "labels": labels[i]}
        for inputs, labels in batches
        for i in range(len(labels))
    ]
    columns = [*batches[0][0]]  # the model's inputs (with "labels" where it reads them)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        history = mf.fit(
            build_lm(spec["model"]),
            data,
            plan=spec.get("plan"),
            loss_fn=_lm_loss_fn(spec),
            optimizer=optimizer_factory("sgd"),
            batch_size=spec.get("batch", 8),
            max_steps=len(batches),
            inputs=columns,
            targets="labels",
            shuffle=False,
            progress=False,
        )
    engine = history.engine
    return {
        "losses": history.losses,
        "eval": float(engine.evaluate(_lm_batch(spec, 999))),
        "state": engine.full_state_dict(),
        "warned": [str(w.message) for w in warned],
    }


def lm_run(spec: dict) -> dict:
    """engine.step on SFT-like batches of a language model; losses and final weights.
    "fit": through mf.fit instead (_lm_fit_run)."""
    if spec.get("fit"):
        return _lm_fit_run(spec)
    model = build_lm(spec["model"])
    options = dict(spec.get("options", {}))
    if spec.get("plan") is None:  # the one-process reference: no form to split for
        options = {k: v for k, v in options.items() if k not in ("tp_plan", "pp_split")}
    # the controls' patches hold until the first step, where the engine builds its split
    # (on the first batch: no example_inputs)
    with contextlib.ExitStack() as stack:
        if spec.get("unsummed"):  # negative control: per-head norms' gradient parts unsummed
            stack.enter_context(_tp_gradients_unsummed(check=not spec.get("unchecked")))
        engine = mf.parallelize(
            model,
            spec.get("plan"),
            loss_fn=_lm_loss_fn(spec),
            optimizer=optimizer_factory("sgd"),
            **options,
        )
        if spec.get("local_split_size"):  # with a hand-written plan for GPT-2's fused c_attn
            for module in model.modules():
                if hasattr(module, "split_size"):
                    module.split_size //= engine.plan.tp
        if spec.get("model_mean"):  # negative control: the model's own per-micro-batch mean
            engine.model_loss.sums = False
        if spec.get("tied_unsummed"):  # negative control: tied copies under pp apart
            engine.runner.tied.sum_gradients = lambda: None
        if spec.get("early"):  # the engine's parts read before any batch: built with none
            engine.runner  # noqa: B018
        warned = []
        if spec.get("said"):  # what the steps warned of, returned
            warned = stack.enter_context(warnings.catch_warnings(record=True))
            warnings.simplefilter("always")
        losses = [float(engine.step(_lm_batch(spec, step))) for step in range(spec.get("steps", 3))]
    eval_loss = float(engine.evaluate(_lm_batch(spec, 999)))
    if spec.get("save"):  # a sharded checkpoint, loaded back by the test in one process
        engine.save(spec["save"])
    result = {"losses": losses, "eval": eval_loss, "state": engine.full_state_dict()}
    result["warned"] = [str(w.message) for w in warned]
    if engine.plan.tp > 1:  # what fit's start-up line says tp split
        result["tp_split"] = engine.tp_report and engine.tp_report.describe()
    return result


@contextlib.contextmanager
def _tp_gradients_unsummed(check: bool):
    """tp as it was before parameters acting on column-parallel values had their gradient
    parts summed (Qwen3's q_norm trained apart on each rank); `check=False` also without
    the backward check that refuses such a split."""
    from unittest import mock

    from meshfit.parallel.tensor import apply, derive

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(derive, "_partial_gradients", lambda *_: []))
        if not check:
            stack.enter_context(mock.patch.object(apply, "_check_gradients", lambda *_: None))
        yield


def runs_or_refusals(run, specs: list[dict]) -> list[dict]:
    """run(spec) for each spec in one set of workers; a spec the plan refuses gives
    {"refused": its message} (every rank refuses alike, so the next spec can go on)."""
    results = []
    for spec in specs:
        try:
            results.append(run(spec))
        except mf.MeshfitError as refusal:
            results.append({"refused": str(refusal)})
    return results


def mixed_runs(runs: list[tuple[Callable[[dict], dict], dict]]) -> list[dict]:
    """run(spec) for each (run, spec), refusals kept, in one set of workers: cells of
    several kinds that need the same world share its launch."""
    return [runs_or_refusals(run, [spec])[0] for run, spec in runs]


def many_lm_runs(specs: list[dict]) -> list[dict]:
    """lm_run for each spec, refusals kept (runs_or_refusals)."""
    return runs_or_refusals(lm_run, specs)


def slow_user_code(seconds: float) -> None:
    """A training script's own code that keeps one rank busy (named in the hang's stack)."""
    time.sleep(seconds)


def hang_run(
    how: str, stall_rank: int, dump_dir: str, collective_timeout_s: float = 0, plan: str = "dp=2"
) -> int:
    """Steps under `plan` where `stall_rank` stops after step 2: `sleep` in the script
    (peers wait in step 3), `stop` (SIGSTOP: frozen), or `both_sleep` (every rank busy in
    the script, nobody waits: no hang); `sleep_at_end`: 3 s in its own code after its last
    step, its peers returned (no hang); or inside step 3, in the model's forward
    (`forward`: a hook of its first layer on that rank) or in `loss` (the loss function).
    Returns the steps taken."""
    os.environ["MESHFIT_HANG_DIR"] = dump_dir
    if collective_timeout_s:
        os.environ["MESHFIT_TIMEOUT_S"] = str(collective_timeout_s)
    model, loss_fn = build("deep_mlp")
    # the steps begun: the stall is in step 3's call (the first step's checks and pp's
    # question before its cut call the forward and loss too)
    steps = {"begun": 0, "stalled": False}
    rank = int(os.environ.get("RANK", "0"))

    def stall_inside(kind: str) -> None:
        if how == kind and rank == stall_rank and steps["begun"] == 3 and not steps["stalled"]:
            steps["stalled"] = True
            with open(os.path.join(dump_dir, f"stalled-{rank}"), "w") as f:
                f.write(repr(time.time()))
            slow_user_code(60)

    def loss(outputs, targets):
        stall_inside("loss")
        return loss_fn(outputs, targets)

    model[0].register_forward_hook(lambda *_: stall_inside("forward"))
    engine = mf.parallelize(model, plan, loss_fn=loss, optimizer=optimizer_factory("sgd"))
    # a group of its own for the mismatch: on the engine's groups a lone collective
    # meets the peers' next one of another size (an error, not a hang)
    extra = torch.distributed.new_group() if how == "mismatch" else None
    for step in range(4):
        steps["begun"] = step + 1
        engine.step(make_batch("deep_mlp", 8, step))
        if how == "mismatch" and rank == stall_rank and step == 1:
            torch.distributed.all_reduce(torch.zeros(1), group=extra)  # its peers skip it
        in_script = how in ("sleep", "stop", "both_sleep", "sleep_at_end")
        stalls = in_script and (rank == stall_rank or how == "both_sleep")
        if stalls and step == (3 if how == "sleep_at_end" else 1):
            with open(os.path.join(dump_dir, f"stalled-{rank}"), "w") as f:
                f.write(repr(time.time()))  # when the stall began, for the test's clock
            if how == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            else:
                slow_user_code(60 if how == "sleep" else 3)
    return engine.step_count


class SlowSamples(torch.utils.data.Dataset):
    """The deep_mlp's samples; on rank `stall_rank`, sample `at` takes a minute to load."""

    def __init__(self, stall_rank: int, at: int, dump_dir: str) -> None:
        self.x, self.y = make_batch("deep_mlp", 64, 0)
        self.stall_rank, self.at, self.dump_dir = stall_rank, at, dump_dir

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        if i == self.at and int(os.environ.get("RANK", "0")) == self.stall_rank:
            slow_user_code(60)
        return self.x[i], self.y[i]


def hang_fit(how: str, stall_rank: int, dump_dir: str, plan: str) -> int:
    """mf.fit under `plan` where `stall_rank` stops in its own code between steps: in
    `data` loading (a sample of step 3) or in a `callback` after step 2."""
    os.environ["MESHFIT_HANG_DIR"] = dump_dir
    model, loss_fn = build("deep_mlp")
    rank = int(os.environ.get("RANK", "0"))

    def callback(step: int, engine) -> None:
        if how == "callback" and rank == stall_rank and step == 2:
            slow_user_code(60)

    # sample 44: in step 6's batch (40-47), on rank 1 also when dp splits it (44-47)
    data = SlowSamples(stall_rank, 44 if how == "data" else -1, dump_dir)
    history = mf.fit(
        model, data, plan=plan, loss_fn=loss_fn, batch_size=8, max_steps=6, shuffle=False,
        progress=False, callbacks=[callback], optimizer=optimizer_factory("sgd"),
    )  # fmt: skip
    return len(history)


def resume_runs(specs: list[dict], dirs: list[str]) -> list[dict]:
    """For each spec in one set of workers: `steps` straight, then half of them with
    checkpoints, then a second fit that resumes to `steps` (as a restarted job would)."""
    results = []
    for spec, where in zip(specs, dirs, strict=True):
        straight = fit_run(spec)
        saved = {**spec, "checkpoint_dir": where, "checkpoint_every": 2}
        fit_run({**saved, "steps": spec["steps"] // 2})
        results.append({"straight": straight, "resumed": fit_run(saved)})
    return results


# ---- failing disks (test_save_failures.py) ---------------------------------------


def no_space(*args, **kwargs):
    """What a write on a full disk raises."""
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def io_error(*args, **kwargs):
    """What a read from a failing disk raises."""
    raise OSError(errno.EIO, os.strerror(errno.EIO))


@contextlib.contextmanager
def disk_full_at(where: str):
    """Make one kind of checkpoint write fail with ENOSPC inside the block: "dcp" (DCP's
    data files), "rank_state" (meshfit's per-rank file), or EIO at "hash" (reading the
    files back for their checksums)."""
    import torch.distributed.checkpoint.filesystem as dcp_files

    from meshfit.state import checkpoint, integrity

    real_save = torch.save

    def save_failing_on_rank_files(obj, f, *args, **kwargs):
        if isinstance(f, str) and os.sep + "ranks" + os.sep in f:
            no_space()
        return real_save(obj, f, *args, **kwargs)

    real_digest = integrity.file_digest

    def digest_failing_while_saving(path):
        if checkpoint.PARTIAL_SUFFIX + os.sep in path:  # not when resuming (a load)
            io_error()
        return real_digest(path)

    module, name, replacement = {
        "dcp": (dcp_files, "_write_item", no_space),
        "rank_state": (checkpoint.torch, "save", save_failing_on_rank_files),
        "hash": (integrity, "file_digest", digest_failing_while_saving),
    }[where]
    original = getattr(module, name)
    setattr(module, name, replacement)
    try:
        yield
    finally:
        setattr(module, name, original)


def save_fails_on_one_rank(spec: dict, failing_rank: int, points: list[str], out: str) -> dict:
    """Train and checkpoint at step 2 under spec's plan, then for each failure point
    continue to step 4 with that write failing on `failing_rank` only. Every rank writes
    what it ended with to `out/<point>-rank-<r>.txt`: the MeshfitError line, or "ok"."""
    first = fit_run({**spec, "steps": 2})
    rank = int(os.environ["RANK"])
    for point in points:
        failing = disk_full_at(point) if rank == failing_rank else contextlib.nullcontext()
        try:
            with failing:
                fit_run({**spec, "steps": 4})
            outcome = "ok"
        except mf.MeshfitError as exc:
            outcome = f"MeshfitError: {exc}"
        with open(os.path.join(out, f"{point}-rank-{rank}.txt"), "w") as f:
            f.write(outcome)
    return first


def plan_errors(plans: list[str]) -> list[str | None]:
    """parallelize under each plan; the MeshfitError message of each (None: it worked)."""
    errors: list[str | None] = []
    for plan in plans:
        try:
            mf.parallelize(torch.nn.Linear(2, 2), plan, loss_fn=F.mse_loss)
            errors.append(None)
        except mf.MeshfitError as exc:
            errors.append(str(exc))
    return errors


def masked_lm(kind: str):
    """A transformers masked-LM model in float64: "esm" (ESM, whose contact head its MLM
    loss never uses), "bert", or "bert_z" (BERT whose forward adds a z-loss over every
    token's logits to its own loss, as a user's subclass might: not a mean over the
    labels); or a token classifier (NER) with its own mean over the labels that are not
    -100: "bert_ner" (`CrossEntropyLoss()`), "llama_ner" (transformers' shared loss,
    called without the count; it computes in float32); "clvp", a causal LM whose own
    `CrossEntropyLoss()` is a mean over the labels it shifts itself; "segformer", a semantic
    segmentation whose own loss is a mean over the pixels not labelled 255; "t5" or
    "bart", an encoder-decoder whose own loss is a mean over its labels; "bart_decoder",
    BART's decoder alone (BartForCausalLM: its `CrossEntropyLoss()` over its labels as
    they stand, not shifted)."""
    from transformers import (
        BertConfig,
        BertForMaskedLM,
        BertForTokenClassification,
        EsmConfig,
        EsmForMaskedLM,
        LlamaConfig,
        LlamaForTokenClassification,
    )

    class BertZForMaskedLM(BertForMaskedLM):
        def forward(self, **kwargs):
            out = super().forward(**kwargs)
            out.loss = out.loss + 0.5 * out.logits.logsumexp(-1).pow(2).mean()
            return out

    torch.manual_seed(1234)
    if kind.startswith("esm"):  # "esm_dropout": its config's hidden dropout, 0.1
        dropout = 0.1 if kind == "esm_dropout" else 0.0
        config = EsmConfig(
            vocab_size=33, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=64, pad_token_id=1,
            mask_token_id=32, token_dropout=False, position_embedding_type="rotary",
            hidden_dropout_prob=dropout, attention_probs_dropout_prob=0.0,
        )  # fmt: skip
        return EsmForMaskedLM(config).double()
    if kind in ("t5", "bart", "bart_decoder"):
        from transformers import (
            BartConfig,
            BartForCausalLM,
            BartForConditionalGeneration,
            T5Config,
            T5ForConditionalGeneration,
        )

        if kind == "t5":
            config = T5Config(
                vocab_size=33, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=4,
                dropout_rate=0.0, pad_token_id=0, decoder_start_token_id=0,
            )  # fmt: skip
            return T5ForConditionalGeneration(config).double()
        config = BartConfig(
            vocab_size=33, d_model=16, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=32,
            decoder_ffn_dim=32, max_position_embeddings=64, pad_token_id=1, bos_token_id=0,
            eos_token_id=2, decoder_start_token_id=2, dropout=0.0, attention_dropout=0.0,
            activation_dropout=0.0,
        )  # fmt: skip
        build = BartForCausalLM if kind == "bart_decoder" else BartForConditionalGeneration
        return build(config).double()
    if kind == "clvp":  # CLVP's speech decoder: its own CrossEntropyLoss() after its own shift
        from transformers import ClvpDecoderConfig, ClvpForCausalLM

        config = ClvpDecoderConfig(
            vocab_size=33, max_position_embeddings=64, max_text_tokens=32, hidden_size=16,
            num_hidden_layers=2, num_attention_heads=4, n_inner=32, resid_pdrop=0.0,
            embd_pdrop=0.0, attention_dropout=0.0, bos_token_id=0, eos_token_id=1,
            feature_size=8,
        )  # fmt: skip
        return ClvpForCausalLM(config).double()
    if kind == "segformer":
        from transformers import SegformerConfig, SegformerForSemanticSegmentation

        config = SegformerConfig(
            num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[8, 16],
            patch_sizes=[3, 3], strides=[2, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2],
            decoder_hidden_size=16, num_labels=4, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0, drop_path_rate=0.0,
        )  # fmt: skip
        return SegformerForSemanticSegmentation(config).double()
    if kind == "llama_ner":
        config = LlamaConfig(
            vocab_size=33, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            num_labels=5, pad_token_id=0, classifier_dropout=0.0,
        )  # fmt: skip
        return LlamaForTokenClassification(config).double()
    config = BertConfig(
        vocab_size=33, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=64, num_labels=5,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    kinds = {
        "bert": BertForMaskedLM,
        "bert_z": BertZForMaskedLM,
        "bert_ner": BertForTokenClassification,
    }
    return kinds[kind](config).double()


def masked_lm_batch(kind: str, step: int) -> dict:
    """4 rows of 12 tokens: for ESM every label set; for BERT a collator's: 30% of the
    first two rows' tokens masked (id 32) and labelled, -100 elsewhere (the last two rows
    none: a dp=2 rank with no label at all); for a token classifier, a tag on a word's
    first piece of the first two rows (counts differ), none on the last two; for a
    segmentation, images whose first 0-11 rows of pixels are ignored (255); for an
    encoder-decoder, targets of 3, 8, 5 and 4 tokens, -100 after them (for CLVP's
    decoder, rows of 3, 8, 5 and 4 tokens padded, as a collator pads them)."""
    g = torch.Generator().manual_seed(7 + step)
    if kind == "segformer":  # 16 x 16 images, 255 over the first rows of pixels (0-7 rows)
        labels = torch.randint(0, 4, (4, 16, 16), generator=g)
        for i in range(4):
            labels[i, : 2 * i + i % 2 * 5] = 255
        return {"pixel_values": torch.randn(4, 3, 16, 16, generator=g).double(), "labels": labels}
    ids = torch.randint(4, 32, (4, 12), generator=g)
    if kind.startswith("esm"):
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    if kind == "clvp":  # a causal LM's collator: its ids padded, their labels -100, masked
        labels = ids.clone()
        for i, n in enumerate((3, 8, 5, 4)):
            labels[i, n:] = -100
        return {"input_ids": ids, "attention_mask": (labels != -100).long(), "labels": labels}
    if kind in ("t5", "bart", "bart_decoder"):  # targets of 3-8 tokens, then -100
        targets = torch.randint(4, 32, (4, 12 if kind == "bart_decoder" else 8), generator=g)
        for i, n in enumerate((3, 8, 5, 4)):
            targets[i, n:] = -100
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": targets}
    if kind.endswith("_ner"):  # a word's later pieces -100: 2 of 3 on the first rows, none after
        tags = torch.randint(0, 5, ids.shape, generator=g)
        tags[:2, 1::3], tags[:2, 2::3], tags[2:] = -100, -100, -100
        tags[0, 4:] = -100
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": tags}
    chosen = torch.rand(ids.shape, generator=g) < 0.3
    chosen[2:] = False
    chosen[0, 0] = True
    return {
        "input_ids": ids.masked_fill(chosen, 32),
        "attention_mask": torch.ones_like(ids),
        "labels": ids.masked_fill(~chosen, -100),
    }


def masked_lm_runs(specs: list[dict]) -> list[dict]:
    """Each spec's "model" (masked_lm) under its "plan" (and "frozen": ESM's contact head
    frozen) over 2 SGD steps with its own loss (loss_fn="model"); the losses and the
    weights after, or the refusal and the names of the weights that moved."""
    results = []
    for spec in specs:
        model = masked_lm(spec["model"])
        if spec.get("frozen"):
            model.esm.contact_head.requires_grad_(False)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        engine = mf.parallelize(
            model, spec["plan"], loss_fn="model", optimizer=optimizer_factory("sgd")
        )
        said = io.StringIO()  # what meshfit printed (rank 0)
        try:
            with contextlib.redirect_stdout(said):
                losses = [float(engine.step(masked_lm_batch(spec["model"], s))) for s in range(2)]
        except mf.MeshfitError as refusal:
            after = engine.full_state_dict()
            moved = [n for n, t in before.items() if not torch.equal(after[n], t)]
            results.append({"refused": str(refusal), "moved": moved})
            continue
        weights = engine.full_state_dict()
        results.append({"losses": losses, "weights": weights, "said": said.getvalue()})
    return results


# ---- Keras 3 models on the torch backend (issue 11) ------------------------------------
def keras_model(kind: str):
    """A Keras 3 model (torch backend), built as Keras users build them."""
    os.environ.setdefault("KERAS_BACKEND", "torch")
    import keras

    keras.utils.set_random_seed(1234)
    layers = [keras.Input((8,)), keras.layers.Dense(32, activation="tanh")]
    if kind == "keras_bn":
        layers.append(keras.layers.BatchNormalization())
    layers += [keras.layers.Dense(32, activation="tanh"), keras.layers.Dense(5)]
    return keras.Sequential(layers)


def keras_run(spec: dict) -> dict:
    """engine.step on a Keras model; losses and final weights in the model's order
    (Keras names layers from a process-wide counter, so a second build in one process
    has other names: compare by position)."""
    model = keras_model(spec["model"])
    engine = mf.parallelize(
        model, spec.get("plan"), loss_fn=F.cross_entropy, optimizer=optimizer_factory("sgd")
    )
    losses = []
    for step in range(4):
        x, y = make_batch("mlp", 16, step, "float32")
        losses.append(float(engine.step((x, y))))
    from zoo import keras_state_by_position  # the state in model.weights' order

    state = keras_state_by_position(model, engine.full_state_dict())
    return {"losses": losses, "weights": [state[str(i)] for i in range(len(state))]}


def many_keras_runs(specs: list[dict]) -> list[dict]:
    """keras_run for each spec, refusals kept (runs_or_refusals)."""
    return runs_or_refusals(keras_run, specs)


def export_run(plan: str, directory: str) -> dict:
    """GPT-2 (tied embeddings) trained a step under `plan`, saved as a checkpoint and as
    a model directory; its full state for comparison."""
    model = build_lm("gpt2", "float32")
    engine = mf.parallelize(model, plan, loss_fn="model")
    engine.step(sft_batch("gpt2", 8, 0))
    engine.save(os.path.join(directory, "checkpoint"))
    engine.save_model(os.path.join(directory, "model"))
    return engine.full_state_dict()


def _mean_abs_logit(outputs, targets):
    """A metric that is a plain mean over the micro-batch."""
    return outputs.abs().mean()


def metric_run(plan: str | None) -> dict:
    """Three steps and an evaluation of the 4-block GPT with accuracy (a (sum, count)
    metric) and a mean metric; the values engine.last_metrics holds after each."""
    model, loss_fn = build("gpt4")
    engine = mf.parallelize(
        model,
        plan,
        loss_fn=loss_fn,
        optimizer=optimizer_factory("sgd"),
        metrics={"acc": mf.metrics.accuracy, "mean_abs": _mean_abs_logit},
    )
    seen = []
    for step in range(3):
        engine.step(make_batch("gpt4", 16, step))
        seen.append({k: float(v) for k, v in engine.last_metrics.items()})
    engine.evaluate(make_batch("gpt4", 16, 99))
    seen.append({k: float(v) for k, v in engine.last_metrics.items()})
    return {"metrics": seen}


class SampleStream(torch.utils.data.IterableDataset):
    """`dataset("mlp", n)`'s samples as a stream, in order (as a streaming dataset
    yields them)."""

    def __init__(self, n: int) -> None:
        self.x, self.y = dataset("mlp", n)

    def __iter__(self):
        yield from zip(self.x, self.y, strict=True)


def stream_fit(spec: dict) -> dict:
    """fit on a stream (or, with map_style, the same samples as a dataset read in
    order); losses and final weights."""
    model, loss_fn = build("mlp")
    data = dataset("mlp", 48) if spec.get("map_style") else SampleStream(48)
    history = mf.fit(
        model,
        data,
        loss_fn=loss_fn,
        batch_size=8,
        max_steps=spec.get("steps", 5),
        shuffle=False,
        plan=spec.get("plan"),
        checkpoint_dir=spec.get("checkpoint_dir"),
        progress=False,
        optimizer=optimizer_factory("adamw"),
    )
    return {"losses": history.losses, "state": history.engine.full_state_dict()}


def predict_runs(plans: list[str]) -> list[dict]:
    """engine.predict under each plan on one batch: the 4-block GPT's logits and a
    Hugging Face Llama's output object (its logits)."""
    results = []
    for plan in plans:
        gpt, _ = build("gpt4")
        engine = mf.parallelize(
            gpt, plan, loss_fn=next_token_loss, optimizer=optimizer_factory("sgd")
        )
        logits = engine.predict(make_batch("gpt4", 8, 0)[0])
        llama = mf.parallelize(hf_llama().double(), plan, loss_fn=next_token_loss_of_output)
        output = llama.predict({"input_ids": make_batch("gpt4", 8, 1)[0]})
        results.append({"gpt": logits, "llama": output.logits, "kind": type(output).__name__})
    return results


def mf_predict_runs(checkpoint: str, plans: list[str]) -> list[torch.Tensor]:
    """mf.predict as a user calls it after training: a fresh model, the checkpoint, a
    plan, 13 inputs in global batches of 4 (the last one padded to split)."""
    inputs = make_batch("gpt4", 13, 5)[0]
    return [
        mf.predict(build("gpt4")[0], inputs, checkpoint=checkpoint, plan=plan, batch_size=4)
        for plan in plans
    ]


# ---- models built on meta (issue 30) -------------------------------------------------
def meta_model(kind: str, on_meta: bool = True) -> tuple[torch.nn.Module, object, object]:
    """(model, loss_fn, init) of `kind` as a user builds it: under
    ``torch.device("meta")`` when `on_meta`, else on the CPU; from seed 1234, float32.
    init: what parallelize needs besides the model's own initialisation (meshfit's GPT
    applies two passes of its own)."""
    torch.manual_seed(1234)
    with torch.device("meta") if on_meta else contextlib.nullcontext():
        if kind in ("gpt", "gpt4"):
            model = GPT(TINY_GPT if kind == "gpt" else GPT4)
            return model, next_token_loss, model.init_passes()
        if kind == "llama":
            from transformers import LlamaForCausalLM

            return LlamaForCausalLM(llama_config()), lm_loss("llama"), None
        model = build_lm(kind, dtype="float32")  # seeds 1234 itself
        return model, lm_loss(kind), None


def meta_run(spec: dict) -> dict:
    """A model built on meta (spec["model"], a meta_model kind) under spec["plan"]: its
    initial state, gathered, then `steps` SGD steps' losses and final state, in float64
    (converted on meta: both runs initialise in float64). Under a pipeline plan the
    example batch fit would give is passed. spec["peak"]: also measure this rank's peak of
    live tensor bytes while parallelize materializes it (memory_probe)."""
    from meshfit.planner.memory_probe import measure_peak

    kind = spec["model"]
    model, loss_fn, init = meta_model(kind, on_meta=spec.get("meta", True))
    model = model.to(torch.float64)
    batch = _meta_batch(kind, spec.get("batch", 8), 0)
    options = {"init": init, "weights": spec.get("weights")}
    if spec.get("plan") and "pp=" in spec["plan"]:
        options["example_inputs"] = _example_inputs(batch)
    holder = {}

    def build() -> None:
        holder["engine"] = mf.parallelize(
            model, spec.get("plan"), loss_fn=loss_fn, optimizer=optimizer_factory("sgd"), **options
        )

    peak = measure_peak(build) if spec.get("peak") else build()
    engine = holder["engine"]
    initial = engine.full_state_dict()
    losses = [
        float(engine.step(_meta_batch(kind, spec.get("batch", 8), step)))
        for step in range(spec.get("steps", 3))
    ]
    return {
        "initial": initial,
        "losses": losses,
        "state": engine.full_state_dict(),
        "peak": _on_every_rank(peak.total if peak else 0),
        "model_bytes": sum(t.numel() * t.element_size() for t in initial.values()),
    }


def _example_inputs(batch: object) -> object:
    """Two samples of a batch's inputs, as fit gives a pipeline: of (inputs, targets),
    or of the mapping a model with its own loss takes (less its labels)."""
    if isinstance(batch, dict):
        return {k: v[:2] for k, v in batch.items() if k != "labels"}
    return map_tree(batch[0], lambda t: t[:2])


def _meta_batch(kind: str, batch: int, step: int) -> object:
    if kind in ("gpt", "gpt4"):
        return make_batch("gpt", batch, step)
    return sft_batch(kind, batch, step)


def map_tree(tree: object, fn) -> object:
    return mf.trees.map_tensors(tree, fn)


def many_meta_runs(specs: list[dict]) -> list[dict]:
    return runs_or_refusals(meta_run, specs)


def save_sharded_run(spec: dict, path: str) -> dict:
    """meta_run's model under spec["plan"], one step, then engine.save_model(path) in
    shards of 20 KB; the gathered state to compare with what was written."""
    model, loss_fn, init = meta_model(spec["model"])
    options = {"init": init}
    if "pp=" in spec["plan"]:
        options["example_inputs"] = _example_inputs(_meta_batch(spec["model"], 8, 0))
    engine = mf.parallelize(model, spec["plan"], loss_fn=loss_fn, **options)
    engine.step(_meta_batch(spec["model"], 8, 0))
    written = engine.save_model(path, max_shard_size="20KB")
    return {"state": engine.full_state_dict(), "written": written}


def dropout_tp_runs(specs: list[dict]) -> list[tuple[float, str | None]]:
    """A GPT with dropout trained under spec["plan"] a few steps, through fit or the
    engine (after seeding each process by its rank, as scripts often do); how far apart
    the ranks' copies of a parameter ended (verify.replica_gap). spec["unshared"]: the
    negative control, tp ranks drawing their own masks (as before issue 32's fix)."""
    from unittest import mock

    from meshfit.parallel.tensor import apply
    from meshfit.topology import Topology
    from meshfit.verification.run import replica_gap

    gaps = []
    for spec in specs:
        with contextlib.ExitStack() as stack:
            if spec.get("unshared"):
                stack.enter_context(mock.patch.object(apply, "_share_random_state", lambda m: None))
                own = property(lambda self: self.rank)
                stack.enter_context(mock.patch.object(Topology, "random_stream", own))
            model, loss_fn = build("gpt4_dropout")
            if spec["via"] == "fit":
                history = mf.fit(
                    model,
                    dataset("gpt4", 32),
                    plan=spec["plan"],
                    loss_fn=loss_fn,
                    optimizer=optimizer_factory("sgd"),
                    batch_size=8,
                    max_steps=3,
                    progress=False,
                )
                engine = history.engine
            else:
                torch.manual_seed(100 + int(os.environ.get("RANK", "0")))
                engine = mf.parallelize(
                    model, spec["plan"], loss_fn=loss_fn, optimizer=optimizer_factory("sgd")
                )
                for step in range(3):
                    engine.step(make_batch("gpt4", 8, step))
            gaps.append(replica_gap(engine))
    return gaps


# ---- workers capped below the model's size (issue 30) -------------------------------
CAPPED_LLAMA = dict(
    vocab_size=1024,
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=16,
    num_attention_heads=12,
    num_key_value_heads=12,
    max_position_embeddings=LM_LEN,
)


def capped_llama_build(
    directory: str, plan: str | None, cgroup: str | None, on_meta: bool, steps: int = 0
) -> dict:
    """A user's fine-tuning start: the 150M-parameter Llama saved in `directory`, built on
    meta (or, the negative control, on the CPU), its weights read with weights= under
    `plan`. With `cgroup`, this process first joins the memory cgroup `<cgroup>-<rank>`
    (made by the test, capped below the model's fp32 size): what it allocates from then
    on counts against the cap; the interpreter, torch and the libraries it loads before
    do not. Returns {parameter: float64 sum of its whole value} for the parameters this
    rank's stages hold (one tensor gathered at a time), and the cgroup's peak usage;
    with `steps`, the losses of that many SGD steps trained after the load, and the
    cgroup's peak after them ("train_peak")."""
    return _capped_phase(directory, plan, _join_capped(cgroup), on_meta, steps)


def capped_llama_phases(directory: str, cgroup: str, phases: list[tuple[str, int]]) -> list:
    """capped_llama_build on meta for each (plan, steps) of `phases` in turn, in the same
    workers (a spawned worker's start-up costs more than the build). The first phase runs
    with glibc's defaults; before each later one the engine is dropped, glibc gives back
    what it freed (malloc_trim) and returns every freed block over 64 KiB from then on
    (what MALLOC_MMAP_THRESHOLD_=65536 sets at start-up: the mmap threshold, set in the
    environment too, which meshfit's build restores after lowering it, and the trim
    threshold back at its 128 KiB, which glibc's dynamic rule raised), and the cgroup's
    peak is reset; "start" is the usage then (what the phase before left behind)."""
    import ctypes
    import gc

    where = _join_capped(cgroup)
    results = []
    for i, (plan, steps) in enumerate(phases):
        if i:
            gc.collect()
            libc = ctypes.CDLL("libc.so.6")
            libc.malloc_trim(0)
            os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
            libc.mallopt(-3, 65536)  # M_MMAP_THRESHOLD
            libc.mallopt(-1, 128 * 1024)  # M_TRIM_THRESHOLD, glibc's default
            torch.distributed.barrier()  # every rank's peak reset after every rank freed
            with open(os.path.join(where, "memory.max_usage_in_bytes"), "w") as f:
                f.write("0")
        start = _on_every_rank(_cgroup_peak(where))
        results.append({**_capped_phase(directory, plan, where, True, steps), "start": start})
    return results


def _join_capped(cgroup: str | None) -> str | None:
    import safetensors.torch  # noqa: F401 - code loaded before the cap, not the model's memory
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.pipelining  # noqa: F401
    from transformers import LlamaForCausalLM  # noqa: F401

    import meshfit.parallel.pipeline  # noqa: F401
    import meshfit.weights.materialize  # noqa: F401

    rank = int(os.environ.get("RANK", "0"))
    where = f"/sys/fs/cgroup/memory/{cgroup}-{rank}" if cgroup else None
    if where:
        with open(os.path.join(where, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    return where


def _capped_phase(
    directory: str, plan: str | None, where: str | None, on_meta: bool, steps: int
) -> dict:
    from torch.distributed.tensor import DTensor
    from transformers import LlamaForCausalLM

    with torch.device("meta") if on_meta else contextlib.nullcontext():
        model = LlamaForCausalLM(llama_config(**CAPPED_LLAMA))
    options = {}
    if "pp=" in (plan or ""):
        options["example_inputs"] = _example_inputs(sft_batch("llama", 8, 0))
    # plain SGD: no optimizer state, so a rank's steady state is its shard of the
    # parameters and their gradients (half the cap under fsdp=4)
    engine = mf.parallelize(
        model, plan, loss_fn=lm_loss("llama"),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.05), weights=directory,
        **options,
    )  # fmt: skip
    sums = {}
    for name, param in engine.user_model.named_parameters():
        whole = param.full_tensor() if isinstance(param, DTensor) else param.detach()
        sums[name] = float(whole.double().sum())
        del whole
    peak = _cgroup_peak(where)
    losses = [float(engine.step(sft_batch("llama", 8, step))) for step in range(steps)]
    everyone: dict = {}
    for part in _on_every_rank(sums):
        everyone.update(part)
    return {
        "sums": everyone,
        "peak": _on_every_rank(peak),
        "losses": losses,
        "train_peak": _on_every_rank(_cgroup_peak(where)),
    }


def _cgroup_peak(where: str | None) -> int | None:
    if not where:
        return None
    with open(os.path.join(where, "memory.max_usage_in_bytes")) as f:
        return int(f.read())


def checkpoint_weights_run(path: str) -> dict:
    """A GPT-2 (tied LM head) trained two steps under fsdp=2 and saved with engine.save
    to `path`; then the same model built on meta under pp=2 and dp=2 with
    weights=<that checkpoint>: the state it starts from and its step count; and a Llama
    given the GPT-2's checkpoint (refused)."""
    model, loss_fn, _ = meta_model("gpt2", on_meta=False)
    sgd = optimizer_factory("sgd")
    engine = mf.parallelize(model, "fsdp=2", loss_fn=loss_fn, optimizer=sgd)
    for step in range(2):
        engine.step(_meta_batch("gpt2", 8, step))
    engine.save(path)
    out: dict = {"saved": engine.full_state_dict()}
    for plan in ("pp=2", "dp=2"):
        model, loss_fn, init = meta_model("gpt2")
        options = {"init": init, "weights": path}
        if "pp=" in plan:
            options["example_inputs"] = _example_inputs(_meta_batch("gpt2", 8, 0))
        started = mf.parallelize(model, plan, loss_fn=loss_fn, optimizer=sgd, **options)
        out[plan] = {"state": started.full_state_dict(), "steps": started.step_count}
    other, other_loss, _ = meta_model("llama")
    try:
        mf.parallelize(other, "fsdp=2", loss_fn=other_loss, weights=path)
        out["refused"] = None
    except mf.MeshfitError as error:
        out["refused"] = str(error)
    return out


def gpt2_tp_resume(plan: str, path: str, load: bool, steps: int) -> list[float]:
    """GPT-2 (its q|k|v fused, split chunk by chunk under tp) with AdamW and a StepLR:
    `steps` steps from a fresh start, saved to `path`; or, with `load`, resumed from it
    for `steps` more. The losses."""
    model = build_lm("gpt2")
    engine = mf.parallelize(
        model,
        plan,
        loss_fn=lm_loss("gpt2"),
        optimizer=optimizer_factory("adamw"),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5),
    )
    if load:
        engine.load(path)
    start = engine.step_count
    losses = [float(engine.step(sft_batch("gpt2", 8, start + s))) for s in range(steps)]
    if not load:
        engine.save(path)
    return losses


def unseeded_runs(specs: list[dict]) -> list[dict]:
    """Each spec trained with the workers' models drawn apart, as when no seed is set
    before the build: rank 0 keeps build()'s values (the one-process reference), the
    others redraw theirs. `keep_own` (negative control): meshfit does not copy rank 0's."""
    import warnings

    from meshfit.weights import same_start

    results = []
    for spec in specs:
        rank = int(os.environ.get("RANK", "0"))
        model, loss_fn = build(
            spec.get("model_on_rank1", spec["model"]) if rank == 1 else spec["model"]
        )
        if "model_on_rank1" in spec:  # another model on rank 1: refused on every rank
            try:
                mf.parallelize(model, spec["plan"], loss_fn=loss_fn)
            except mf.MeshfitError as refusal:
                results.append({"refused": str(refusal)})
            continue
        if rank != 0:
            generator = torch.Generator().manual_seed(99 + rank)
            with torch.no_grad():
                for p in model.parameters():
                    p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * 0.1)
        original = same_start.start_from_rank0
        if spec.get("keep_own"):
            same_start.start_from_rank0 = lambda model: False
        try:  # through the first step: tp and pp build there (no example_inputs)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                engine = mf.parallelize(
                    model, spec["plan"], loss_fn=loss_fn, optimizer=optimizer_factory("sgd")
                )
                losses = [float(engine.step(make_batch(spec["model"], 16, 0)))]
        finally:
            same_start.start_from_rank0 = original
        losses += [float(engine.step(make_batch(spec["model"], 16, step))) for step in (1, 2)]
        warned = [str(w.message) for w in caught if "initial weights" in str(w.message)]
        results.append({"losses": losses, "state": engine.full_state_dict(), "warned": warned})
    return results


def guarded_save(path: str, call: str = "save_model") -> None:
    """A habit from other trainers: the save under `if engine.rank == 0:` (meshfit's
    saves are collectives: every rank gives its part)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    engine = mf.parallelize(model, "fsdp=2", loss_fn=F.mse_loss)
    engine.step((torch.randn(4, 8), torch.randn(4, 4)))
    if engine.rank == 0:
        if call == "save_model":
            engine.save_model(path)
        else:
            engine.save(path)
