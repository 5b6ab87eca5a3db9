"""Models, losses and worker runs for the tests of losses that couple the samples of a
batch (tests/test_coupling.py; the zoo's CLIP, SigLIP, sentence pairs and MoE families
with their load-balancing loss are in tests/zoo.py)."""

from __future__ import annotations

import contextlib
import io
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from zoo import FAMILIES, zoo_optimizer

import meshfit as mf


class BatchCentered(nn.Module):
    """Subtracts the batch's mean: couples the samples as BatchNorm does, without being
    one (nothing meshfit knows)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(0, keepdim=True)


class TrainingCentered(BatchCentered):
    """BatchCentered in training only (as a batch-level step written for training is):
    evaluation's forward keeps the samples apart."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) if self.training else x


def centered_mlp(in_training_only: bool = False) -> nn.Module:
    torch.manual_seed(5)
    centered = TrainingCentered() if in_training_only else BatchCentered()
    return nn.Sequential(nn.Linear(8, 16), centered, nn.Tanh(), nn.Linear(16, 5)).double()


def plain_mlp(dropout: float = 0.0, batchnorm: bool = False) -> nn.Module:
    torch.manual_seed(5)
    layers = [nn.Linear(8, 16)]
    if batchnorm:
        layers.append(nn.BatchNorm1d(16))
    layers += [nn.Dropout(dropout), nn.Tanh(), nn.Linear(16, 5)]
    return nn.Sequential(*layers).double()


def vectors(batch: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 8, generator=g, dtype=torch.float64)
    return x, torch.randint(0, 5, (batch,), generator=g)


def summed_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A sum over the batch divided by a fixed number: no mean of the samples' losses
    but a sum of them (meshfit adds up the parts' sums: losses.SampleSum)."""
    return F.cross_entropy(outputs, targets, reduction="sum") / 4


def worst_sample_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The batch's largest sample loss: neither a mean nor a sum of its samples'."""
    return F.cross_entropy(outputs, targets, reduction="none").max()


def in_batch_negatives(outputs: tuple, _targets: Any) -> torch.Tensor:
    """Every anchor against every positive of the batch, each its own positive's match
    (zoo._in_batch_negatives, written without meshfit)."""
    a, b = outputs
    scores = torch.mm(F.normalize(a, dim=1), F.normalize(b, dim=1).transpose(0, 1)) * 20.0
    return F.cross_entropy(scores, torch.arange(len(scores), device=scores.device))


def gathered_in_batch_negatives(outputs: tuple, _targets: Any) -> torch.Tensor:
    """The same loss, written with mf.gather_batch: the global batch's embeddings."""
    a, b = (mf.gather_batch(t) for t in outputs)
    scores = F.normalize(a, dim=1) @ F.normalize(b, dim=1).T * 20.0
    return F.cross_entropy(scores, torch.arange(len(scores), device=scores.device))


LOSSES = {"in_batch": in_batch_negatives, "gathered": gathered_in_batch_negatives}


def round_order(batch: int, ranks: int, microbatches: int) -> list[int]:
    """The global batch's rows in the order the rounds of micro-batches run them: round
    m holds the m-th micro-batch of every rank, rank after rank (scope.py). One process
    with `microbatches` micro-batches on the rows in this order forms a coupled loss
    over the same samples as the plan does."""
    share, micro = batch // ranks, batch // ranks // microbatches
    return [
        r * share + m * micro + i
        for m in range(microbatches)
        for r in range(ranks)
        for i in range(micro)
    ]


def coupled_run(spec: dict) -> dict:
    """A zoo family (spec["model"]) under spec["plan"] for 3 SGD steps on batches of 8;
    "order": the rows of every batch in this order; "loss": one of LOSSES instead of
    the family's; "local_balancing"/"no_probe": the negative controls (the
    load-balancing statistics of each rank's own tokens; no coupling probe, so nothing
    is gathered); "evaluate_first": an evaluation of the first batch before any step,
    its loss the first of the losses."""
    family = FAMILIES[spec["model"]]
    dtype = getattr(torch, family.dtype)
    torch.manual_seed(1234)
    model = family.build().to(dtype)
    loss_fn = LOSSES[spec["loss"]] if "loss" in spec else family.loss()
    with contextlib.ExitStack() as stack:
        _controls(spec, stack)
        engine = mf.parallelize(model, spec.get("plan"), loss_fn=loss_fn, optimizer=zoo_optimizer)
        losses = []
        if spec.get("evaluate_first"):
            losses.append(float(engine.evaluate(_batch(family, dtype, 0, spec))))
        losses += [float(engine.step(_batch(family, dtype, step, spec))) for step in range(3)]
    return {"losses": losses, "state": engine.full_state_dict()}


def many_coupled_runs(specs: list[dict]) -> list[dict]:
    from workers import runs_or_refusals

    return runs_or_refusals(coupled_run, specs)


def _batch(family: Any, dtype: torch.dtype, step: int, spec: dict) -> Any:
    made = family.batch(8, step)
    order = spec.get("order")

    def fix(t: torch.Tensor) -> torch.Tensor:
        t = t.to(dtype) if t.is_floating_point() else t
        return t[order] if order is not None and t.ndim else t

    if isinstance(made, dict):
        return mf.trees.map_tensors(made, fix)
    inputs, targets = made
    return mf.trees.map_tensors(inputs, fix), fix(targets)


def _controls(spec: dict, stack: contextlib.ExitStack) -> None:
    from unittest import mock

    from meshfit.coupling import batch, moe

    if spec.get("local_balancing"):  # each rank's own tokens' statistics (the old run)
        stack.enter_context(mock.patch.object(moe, "_summed", lambda *sums: sums))
    if spec.get("local_balancing") or spec.get("no_probe"):
        stack.enter_context(
            mock.patch.object(batch.BatchCoupling, "check_first_batch", lambda *a, **k: None)
        )


# ---- losses that sum over the samples (losses.SampleSum) -----------------------------


def wav2vec2_ctc() -> nn.Module:
    """transformers' Wav2Vec2ForCTC, small, from its config: its CTC loss sums over the
    samples (ctc_loss_reduction="sum", the config's default). Dropout, LayerDrop and
    SpecAugment off: the exact match needs no randomness in the model."""
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    torch.manual_seed(11)
    config = Wav2Vec2Config(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32,
        conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=4,
        num_conv_pos_embedding_groups=2, vocab_size=12, pad_token_id=0,
        hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0,
    )  # fmt: skip
    return Wav2Vec2ForCTC(config)


def wav2vec2_batch(batch: int = 8, seed: int = 0) -> dict:
    """As transformers' CTC collator yields a batch: raw audio right-padded with its
    attention mask, the transcripts' ids padded with -100."""
    g = torch.Generator().manual_seed(seed)
    frames = 400
    audio = torch.zeros(batch, frames)
    mask = torch.zeros(batch, frames, dtype=torch.long)
    labels = torch.full((batch, 6), -100)
    for i in range(batch):
        n = int(torch.randint(frames // 2, frames + 1, (), generator=g))
        audio[i, :n], mask[i, :n] = torch.randn(n, generator=g), 1
        k = int(torch.randint(2, 7, (), generator=g))
        labels[i, :k] = torch.randint(1, 12, (k,), generator=g)
    return {"input_values": audio, "attention_mask": mask, "labels": labels}


class ResidualBlock(nn.Module):
    def __init__(self, width: int, centered: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.centered = BatchCentered() if centered else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.centered(self.fc(x)))


class MLPBlock(nn.Module):
    """nanoGPT's MLP with its residual (a pair tensor parallel splits: `fc` by its
    outputs, `proj` by its inputs); with `centered`, its output less the batch's mean."""

    def __init__(self, width: int, centered: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(width, 4 * width)
        self.proj = nn.Linear(4 * width, width)
        self.centered = BatchCentered() if centered else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.centered(self.proj(F.gelu(self.fc(x))))


class ResidualMLP(nn.Module):
    """Blocks with their residual inside (as nanoGPT's Block), or, with
    `residual_in_loop`, added by the forward's loop (`x = x + block(x)`); with
    `loops=2` the forward runs its whole stack twice (a recurrent-depth model); with
    `centered`, its third block subtracts the batch's mean (BatchCentered); with `mlp`,
    the blocks are MLPBlocks (something for tp to split in every block)."""

    def __init__(
        self,
        residual_in_loop: bool = False,
        loops: int = 1,
        centered: bool = False,
        mlp: bool = False,
    ) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.residual_in_loop = residual_in_loop
        self.loops = loops
        self.embed = nn.Linear(8, 16)
        if residual_in_loop:
            self.blocks = nn.ModuleList(
                nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)
            )
        else:
            block = MLPBlock if mlp else ResidualBlock
            self.blocks = nn.ModuleList(block(16, centered and i == 2) for i in range(4))
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for _ in range(self.loops):
            for block in self.blocks:
                x = x + block(x) if self.residual_in_loop else block(x)
        return self.head(x)


def sum_loss_run(spec: dict) -> dict:
    """3 SGD steps of spec["model"] under spec["plan"] (None: one process): its losses
    and final weights, or {"refused": message}."""
    torch.manual_seed(0)
    if spec["model"] == "wav2vec2":
        model, loss_fn = wav2vec2_ctc().double(), "model"
        model.config.layerdrop = spec.get("layerdrop", 0.0)  # LayerDrop: layers skipped at random

        def batch(step: int) -> Any:
            made = wav2vec2_batch(8, step)
            return {k: v.double() if v.is_floating_point() else v for k, v in made.items()}
    else:
        model = ResidualMLP(
            residual_in_loop=spec["model"] == "loop_residual",
            loops=2 if spec["model"] == "looped_stack" else 1,
        ).double()
        loss_fn = summed_loss

        def batch(step: int) -> Any:
            return vectors(seed=step)

    engine = mf.parallelize(model, spec.get("plan"), loss_fn=loss_fn, optimizer=zoo_optimizer)
    if spec.get("undecided"):  # the control: the sum left as a mean, as before
        engine.sample_sum.undecided = False  # neither the last stage's question
        engine.sample_sum.take_before_the_cut = lambda verdict: None  # nor the cut's
    try:
        losses = [float(engine.step(batch(step))) for step in range(3)]
    except mf.MeshfitError as refusal:
        return {"refused": str(refusal)}
    return {"losses": losses, "state": engine.full_state_dict()}


def many_sum_loss_runs(specs: list[dict]) -> list[dict]:
    torch.set_num_threads(1)
    return [sum_loss_run(spec) for spec in specs]


class EMACodebook(nn.Module):
    """A VQ-VAE's codebook kept by exponential moving averages of the vectors each code
    is assigned (no gradient), written the way VQ-VAE code writes it: the cluster sizes
    reassigned (`self.cluster_size = ...`, as the PyTorch ports of Sonnet's
    VectorQuantizerEMA do), the sums and codebook written in place, a step count beside.
    `gather`: the update computed from the global batch's rows (mf.gather_batch), the fix
    meshfit's refusal names."""

    def __init__(self, codes: int = 8, dim: int = 4, decay: float = 0.9, gather: bool = False):
        super().__init__()
        self.decay, self.gather = decay, gather
        embed = torch.randn(codes, dim)
        self.register_buffer("embed", embed)
        self.register_buffer("cluster_size", torch.ones(codes))
        self.register_buffer("embed_avg", embed.clone())
        self.register_buffer("updates", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        distances = (x * x).sum(1, keepdim=True) - 2 * x @ self.embed.t() + (self.embed**2).sum(1)
        onehot = F.one_hot(distances.argmin(1), self.embed.shape[0]).to(x.dtype)
        quantized = onehot @ self.embed
        if self.training:
            with torch.no_grad():
                flat, assigned = x, onehot
                if self.gather:
                    flat, assigned = mf.gather_batch(x), mf.gather_batch(onehot)
                decay = self.decay
                self.cluster_size = self.cluster_size * decay + (1 - decay) * assigned.sum(0)
                self.embed_avg.mul_(decay).add_(assigned.t() @ flat, alpha=1 - decay)
                n = self.cluster_size.sum()
                size = (self.cluster_size + 1e-5) / (n + self.embed.shape[0] * 1e-5) * n
                self.embed.copy_(self.embed_avg / size.unsqueeze(1))
                self.updates += 1
        commitment = F.mse_loss(x, quantized.detach())
        return x + (quantized - x).detach(), commitment


class VQAutoencoder(nn.Module):
    def __init__(self, gather: bool = False):
        super().__init__()
        self.encoder, self.decoder = nn.Linear(8, 4), nn.Linear(4, 8)
        self.vq = EMACodebook(gather=gather)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z, commitment = self.vq(self.encoder(x))
        return self.decoder(z), commitment


class VQStack(nn.Module):
    """The codebook before a stack of blocks (what pipeline parallel cuts): its first
    stage holds the codebook."""

    def __init__(self):
        super().__init__()
        self.encoder, self.decoder = nn.Linear(8, 4), nn.Linear(4, 8)
        self.vq = EMACodebook()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z, _ = self.vq(self.encoder(x))
        for block in self.blocks:
            z = block(z)
        return self.decoder(z)


def vq_loss(outputs: tuple, targets: torch.Tensor) -> torch.Tensor:
    reconstruction, commitment = outputs
    return F.mse_loss(reconstruction, targets) + 0.25 * commitment


def ibert_masked_lm() -> nn.Module:
    """I-BERT (quant_mode off, its default): QuantAct modules keep their activations'
    ranges in buffers, updated by every training forward, read by nothing then."""
    from transformers import IBertConfig, IBertForMaskedLM

    config = IBertConfig(
        vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=64, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    return IBertForMaskedLM(config)


def masked_batch(batch: int = 8, seed: int = 0) -> dict:
    """A masked-LM collator's batch: ids, mask, one masked position per text (-100 elsewhere)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 32, (batch, 8), generator=g)
    labels = torch.full_like(ids, -100)
    labels[:, 2] = ids[:, 2]
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def vq_run(spec: dict) -> dict:
    """The VQ autoencoder (spec["gather"]: its update from the global batch; "model":
    "stack", the codebook before a stack of blocks; "ibert": ibert_masked_lm on
    masked_batch; "eval": the model handed over in evaluation mode; "meta": built on
    meta, its codebook from codebook_init) under spec["plan"]
    for 3 SGD steps on batches of 8 vectors (its targets its inputs); "said": what rank
    0 printed."""
    if spec.get("model") == "ibert":
        engine = mf.parallelize(ibert_masked_lm(), spec.get("plan"), loss_fn="model")
        said = io.StringIO()
        with contextlib.redirect_stdout(said):
            losses = [float(engine.step(masked_batch(seed=step))) for step in range(3)]
        return {"losses": losses, "state": engine.full_state_dict(), "said": said.getvalue()}
    torch.manual_seed(0)
    stack = spec.get("model") == "stack"
    with torch.device("meta") if spec.get("meta") else contextlib.nullcontext():
        model = VQStack() if stack else VQAutoencoder(gather=spec.get("gather", False))
    model = model.double()
    if spec.get("eval"):  # as from_pretrained returns a model: in evaluation mode
        model.eval()
    options = dict(spec.get("options", {}))
    if spec.get("meta"):  # the codebook's values, as a model's own init gives them
        options.update(init=codebook_init, example_inputs=vectors()[0].double())
    loss_fn = F.mse_loss if stack else vq_loss
    engine = mf.parallelize(
        model, spec.get("plan"), loss_fn=loss_fn, optimizer=zoo_optimizer, **options
    )
    losses = []
    for step in range(3):
        x, _ = vectors(seed=step)
        losses.append(float(engine.step((x, x))))
    return {"losses": losses, "state": engine.full_state_dict()}


def codebook_init(module: nn.Module) -> None:
    """The values EMACodebook's constructor draws, for one built on meta."""
    if isinstance(module, EMACodebook):
        embed = torch.randn(module.embed.shape, generator=torch.Generator().manual_seed(3))
        module.embed.copy_(embed)
        module.embed_avg.copy_(embed)
        module.cluster_size.fill_(1.0)
        module.updates.zero_()


def many_vq_runs(specs: list[dict]) -> list[dict]:
    from workers import runs_or_refusals

    torch.set_num_threads(1)
    return runs_or_refusals(vq_run, specs)


def pipeline_coupled_run(spec: dict) -> dict:
    """ResidualMLP (spec["centered"]: a block that subtracts the batch's mean; MLPBlocks
    where spec["model"] is "mlp") under spec["plan"] for 3 SGD steps on batches of 8
    vectors, with spec["loss"] ("worst": worst_sample_loss, else the cross-entropy);
    "eager": built on example inputs given to parallelize (no targets known before the
    cut); "meta": built on meta, given the same example inputs (no values before the
    cut)."""
    torch.manual_seed(0)
    with torch.device("meta") if spec.get("meta") else contextlib.nullcontext():
        mlp = spec.get("model") == "mlp"
        model = ResidualMLP(centered=spec.get("centered", False), mlp=mlp).double()
    loss_fn = worst_sample_loss if spec.get("loss") == "worst" else F.cross_entropy
    eager = spec.get("eager") or spec.get("meta")
    example = {"example_inputs": vectors()[0]} if eager else {}
    engine = mf.parallelize(
        model, spec.get("plan"), loss_fn=loss_fn, optimizer=zoo_optimizer, **example
    )
    if spec.get("again"):  # a refused step, then the weights, then the step again
        before = engine.full_state_dict()
        try:
            engine.step(vectors(seed=0))
        except mf.MeshfitError as refusal:
            kept = all(torch.equal(v, engine.full_state_dict()[k]) for k, v in before.items())
            try:
                engine.step(vectors(seed=0))
            except mf.MeshfitError as again:
                return {"refused": str(refusal), "kept": kept, "again": str(again)}
    losses = [float(engine.step(vectors(seed=step))) for step in range(3)]
    return {"losses": losses, "state": engine.full_state_dict()}


def many_pipeline_coupled_runs(specs: list[dict]) -> list[dict]:
    from workers import runs_or_refusals

    torch.set_num_threads(1)
    return runs_or_refusals(pipeline_coupled_run, specs)
