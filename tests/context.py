"""Models, batches and worker runs for the context-parallel tests (tests/test_context.py):
the zoo's families at a sequence length cp=4 can cut (16 tokens: 2 x 4 chunks of 2),
Mistral with a sliding window shorter than the sequence, a model whose attention is
written by hand (refused), and packed documents."""

from __future__ import annotations

import contextlib
import io
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from zoo import hf_t5, zoo_optimizer

import meshfit as mf

VOCAB = 32
LENGTH = 16
ENCODERS = ("bert", "modernbert", "modernbert_4", "roformer")  # masked-LM batches
MASK = 3  # their mask token's id


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * LENGTH,
        )
    )  # fmt: skip


def qwen3() -> nn.Module:  # per-head q/k norms before the rotation
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=4,
            max_position_embeddings=2 * LENGTH,
        )
    )  # fmt: skip


def gpt2() -> nn.Module:  # learned absolute positions
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(
        GPT2Config(
            vocab_size=VOCAB, n_positions=2 * LENGTH, n_embd=16, n_layer=2, n_head=2,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )
    )  # fmt: skip


def mistral() -> nn.Module:  # a sliding window of 5 tokens, shorter than the sequence
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(
        MistralConfig(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=4,
            max_position_embeddings=2 * LENGTH, sliding_window=5,
        )
    )  # fmt: skip


def gemma2() -> nn.Module:
    """Gemma 2: attention scores capped (softcap x tanh(score / softcap); a cap this
    small makes ignoring it show at the first step), sliding-window layers, RMSNorms
    computed in float32 inside; given its token ids alone, as a tensor."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    return Gemma2ForCausalLM(
        Gemma2Config(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=4, query_pre_attn_scalar=4,
            max_position_embeddings=2 * LENGTH, sliding_window=5, attn_logit_softcapping=0.05,
            final_logit_softcapping=30.0,
        )
    )  # fmt: skip


def exaone4(layers: int = 2) -> nn.Module:
    """EXAONE 4: sliding-window layers with rotary positions, a global layer without
    them; its global layers keep the window's size as an attribute and pass None."""
    from transformers import Exaone4Config, Exaone4ForCausalLM

    return Exaone4ForCausalLM(
        Exaone4Config(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * LENGTH,
            sliding_window=5, sliding_window_pattern=2,
        )
    )  # fmt: skip


def olmo3() -> nn.Module:  # three sliding-window layers, then a global one
    from transformers import Olmo3Config, Olmo3ForCausalLM

    return Olmo3ForCausalLM(
        Olmo3Config(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * LENGTH,
            sliding_window=5,
        )
    )  # fmt: skip


def lfm2() -> nn.Module:  # a short convolution over tokens before its attention layer
    from transformers import Lfm2Config, Lfm2ForCausalLM

    return Lfm2ForCausalLM(
        Lfm2Config(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * LENGTH,
            full_attn_idxs=[1], conv_L_cache=3, block_ff_dim=32,
        )
    )  # fmt: skip


def qwen3_next() -> nn.Module:  # gated delta-net (linear attention) layers, experts
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    return Qwen3NextForCausalLM(
        Qwen3NextConfig(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=4,
            max_position_embeddings=2 * LENGTH, linear_num_value_heads=2,
            linear_num_key_heads=2, linear_key_head_dim=4, linear_value_head_dim=4,
            linear_conv_kernel_dim=2, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=8, shared_expert_intermediate_size=8,
            layer_types=["linear_attention", "full_attention"],
        )
    )  # fmt: skip


def gpt_oss() -> nn.Module:  # attention sinks, sliding windows, experts with biases
    from experts import gpt_oss

    return gpt_oss()


def nanogpt() -> nn.Module:
    from nanogpt import GPT, GPTConfig

    return GPT(GPTConfig(block_size=2 * LENGTH, vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=16))


def meshfit_gpt() -> nn.Module:
    from meshfit.models import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=VOCAB, block_size=2 * LENGTH, n_layer=2, n_head=2, n_embd=16))


class HandAttentionLM(nn.Module):
    """A causal LM whose attention is written by hand with einsum and a causal mask
    buffer, as research code sometimes is: nothing meshfit can find or swap."""

    def __init__(self) -> None:
        super().__init__()
        width = 16
        self.embed = nn.Embedding(VOCAB, width)
        self.position = nn.Embedding(2 * LENGTH, width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.head = nn.Linear(width, VOCAB)
        self.register_buffer("causal", torch.tril(torch.ones(2 * LENGTH, 2 * LENGTH)).bool())

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        length = idx.shape[1]
        x = self.embed(idx) + self.position(torch.arange(length, device=idx.device))
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = torch.einsum("btd,bsd->bts", q, k) / q.shape[-1] ** 0.5
        scores = scores.masked_fill(~self.causal[:length, :length], float("-inf"))
        x = x + self.out(torch.einsum("bts,bsd->btd", scores.softmax(-1), v))
        return self.head(x)


class HandAttentionBlocks(nn.Module):
    """HandAttentionLM's einsum attention inside blocks a pipeline can cut (the stage
    that holds them must name the departing module)."""

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        width = 16
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(_HandBlock(width) for _ in range(layers))
        self.head = nn.Linear(width, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class _HandBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = torch.einsum("btd,bsd->bts", q, k) / q.shape[-1] ** 0.5
        causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        return x + self.out(torch.einsum("bts,bsd->btd", scores.softmax(-1), v))


class TokenStatisticsLM(nn.Module):
    """A causal LM (F.scaled_dot_product_attention, positions from torch.arange) that
    keeps a statistic of the tokens it sees in buffers: `kind="codebook"`, a VQ
    bottleneck over its tokens kept by moving averages (coupled.EMACodebook; read by the
    next forward); `kind="observed"`, the largest activation it has seen (an observer's
    range, read by nothing)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        from coupled import EMACodebook

        width = 16
        self.kind = kind
        self.embed = nn.Embedding(VOCAB, width)
        self.position = nn.Embedding(2 * LENGTH, width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.vq = EMACodebook(codes=8, dim=width) if kind == "codebook" else None
        self.register_buffer("seen_max", torch.zeros(()))
        self.head = nn.Linear(width, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        batch, length = idx.shape
        x = self.embed(idx) + self.position(torch.arange(length, device=idx.device))
        q, k, v = self.qkv(x).view(batch, length, 3, 2, 8).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(batch, length, 16))
        if self.vq is not None:
            x = self.vq(x.reshape(batch * length, 16))[0].view(batch, length, 16)
        if self.training and self.kind == "observed":
            self.seen_max = torch.maximum(self.seen_max, x.detach().abs().max())
        return self.head(x)


def qwen3_moe() -> nn.Module:  # a mixture of experts, its load-balancing loss on
    from experts import qwen3_moe

    return qwen3_moe()


def bert() -> nn.Module:  # an encoder: every token reads every other (is_causal = False)
    from transformers import BertConfig, BertForMaskedLM

    return BertForMaskedLM(
        BertConfig(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=2 * LENGTH,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )
    )  # fmt: skip


def modernbert(layers: int = 2) -> nn.Module:  # a window either side on its local layers
    from transformers import ModernBertConfig, ModernBertForMaskedLM

    return ModernBertForMaskedLM(
        ModernBertConfig(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
            num_attention_heads=4, max_position_embeddings=2 * LENGTH,
            global_attn_every_n_layers=2, local_attention=6,  # layer 1 reads 3 either side
            pad_token_id=0, bos_token_id=1, eos_token_id=2, sep_token_id=2, cls_token_id=1,
        )
    )  # fmt: skip


def roformer() -> nn.Module:  # rotary positions from a frozen sinusoidal table
    from transformers import RoFormerConfig, RoFormerForMaskedLM

    return RoFormerForMaskedLM(
        RoFormerConfig(
            vocab_size=VOCAB, hidden_size=16, embedding_size=16, intermediate_size=32,
            num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=2 * LENGTH,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )
    )  # fmt: skip


def wav2vec2() -> nn.Module:
    """transformers' Wav2Vec2ForCTC, small, with the config's own feature encoder (seven
    convolutions, 320 audio samples a frame): a window of 128 samples is too short."""
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    config = Wav2Vec2Config(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32,
        conv_dim=(8,) * 7, num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2,
        vocab_size=12, pad_token_id=0, layerdrop=0.0, mask_time_prob=0.0,
    )  # fmt: skip
    return Wav2Vec2ForCTC(config)


BUILDS = {
    "wav2vec2": wav2vec2,  # raw audio in: cp cuts its samples, its convolutions fail
    "t5": hf_t5,  # an encoder-decoder: refused under cp from its config
    "bert": bert,
    "modernbert": modernbert,
    "modernbert_4": lambda: modernbert(layers=4),
    "roformer": roformer,
    "llama": llama,
    "qwen3_moe": qwen3_moe,
    "qwen3": qwen3,
    "gpt2": gpt2,
    "mistral": mistral,
    "nanogpt": nanogpt,
    "gpt": meshfit_gpt,
    "hand_attention": HandAttentionLM,
    "hand_blocks": HandAttentionBlocks,
    "gemma2_ids": gemma2,
    "gpt_oss": gpt_oss,
    "exaone4": exaone4,
    "exaone4_6": lambda: exaone4(layers=6),
    "olmo3": olmo3,
    "lfm2": lfm2,
    "qwen3_next": qwen3_next,
    "codebook": lambda: TokenStatisticsLM("codebook"),
    "observed": lambda: TokenStatisticsLM("observed"),
}


def _tokens(batch: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded rows (a collator's), -100 on the padding and a prompt."""
    g = torch.Generator().manual_seed(90_000 + step)
    ids = torch.zeros(batch, LENGTH, dtype=torch.long)
    labels = torch.full((batch, LENGTH), -100)
    mask = torch.zeros(batch, LENGTH, dtype=torch.long)
    for i in range(batch):
        n = int(torch.randint(LENGTH // 2, LENGTH + 1, (), generator=g))
        ids[i, :n] = torch.randint(1, VOCAB, (n,), generator=g)
        mask[i, :n] = 1
        labels[i, 2:n] = ids[i, 2:n]
    return ids, labels, mask


# models given (ids, next tokens) rather than a collator's dict
NEXT_TOKENS = (
    "nanogpt",
    "gpt",
    "hand_attention",
    "hand_blocks",
    "gemma2_ids",
    "codebook",
    "observed",
)


def batch_of(model: str, loss: str, step: int, batch: int = 8) -> Any:
    """A batch as the family's users give it, for `loss` ("pair": mf.losses
    cross_entropy(shift=True) on (inputs, labels); "model": the model's own loss on a
    collator's dict; "next": a nanoGPT-style (x, next tokens))."""
    ids, labels, mask = _tokens(batch, step)
    if model in ENCODERS:  # DataCollatorForLanguageModeling's: 30% masked, labels there
        chosen = torch.rand(ids.shape, generator=torch.Generator().manual_seed(step)) < 0.3
        chosen &= mask.bool()
        labels = ids.masked_fill(~chosen, -100)
        ids = ids.masked_fill(chosen, MASK)
    if model in NEXT_TOKENS:
        data = torch.cat([ids, ids[:, :1]], dim=1)
        x, y = data[:, :-1], data[:, 1:].clone()
        if loss == "masked_mean":  # the collator's -100 where its labels have them
            y[labels == -100] = -100
        if model == "nanogpt":
            return {"idx": x, "targets": y}, y
        return x, y
    if model == "wav2vec2":  # a CTC collator's batch: 1,600 audio samples, float64
        g = torch.Generator().manual_seed(step)
        labels = torch.randint(1, 12, (batch, 6), generator=g)
        labels[::2, 4:] = -100
        audio = torch.randn(batch, 1600, generator=g, dtype=torch.float64)
        return {
            "input_values": audio,
            "attention_mask": torch.ones_like(audio).long(),
            "labels": labels,
        }
    if loss == "model":
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
    return {"input_ids": ids, "attention_mask": mask}, labels


def masked_token_mean(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """F.cross_entropy's default: the mean over the targets that are not -100."""
    return F.cross_entropy(outputs.flatten(0, 1), targets.flatten())


def shifted_here(outputs: Any, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A (sum, count) loss that shifts the labels itself, as much research code does."""
    logits = outputs.logits[:, :-1].flatten(0, 1)
    labels = labels[:, 1:].flatten()
    return F.cross_entropy(logits, labels, reduction="sum"), (labels != -100).sum()


def loss_of(model: str, loss: str) -> Any:
    if loss == "masked_mean":
        return masked_token_mean
    if loss == "shifted_here":
        return shifted_here
    if model in ENCODERS:  # the masked tokens' labels, not shifted
        return "model" if loss == "model" else mf.losses.cross_entropy()
    if model == "gemma2_ids":
        return mf.losses.cross_entropy()  # the targets are the next tokens already
    if model == "nanogpt":
        return lambda outputs, targets: outputs[1]  # the loss its forward computed
    if model in ("gpt", "hand_attention", "hand_blocks", "codebook", "observed"):
        return lambda outputs, targets: F.cross_entropy(outputs.flatten(0, 1), targets.flatten())
    return "model" if loss == "model" else mf.losses.cross_entropy(shift=True)


def cp_run(spec: dict) -> dict:
    """`spec["model"]` under `spec["plan"]` for 3 SGD steps on batches of 8 x 16 tokens
    (float64); "loss": "pair" (default), "model", "masked_mean" or "shifted_here";
    "packed": packed documents instead; "long_prompt": long_prompt_batch instead;
    "left_padded": left_padded_batch instead ("first whole": its first row unpadded);
    "undone_on_rank1": the negative control (rank 1 holds contiguous chunks, not its
    load-balanced pair); "predict": engine.predict first (refused under cp); "metrics":
    mf.metrics.next_token_accuracy beside the loss ("mean": a token mean, refused under
    cp), its value per step in the result; "evaluate_first": an evaluation before the
    first step, its loss the first of the losses ("only": no step after it); "retry": a
    first step refused is tried again (and must be refused again); "float32": the model
    in float32 instead; "options": more keywords for mf.parallelize; "meta": the model
    built on meta (its values from options' weights=); "said": what rank 0 printed."""
    torch.manual_seed(1234)
    with torch.device("meta") if spec.get("meta") else contextlib.nullcontext():
        model = BUILDS[spec["model"]]().to(torch.float32 if spec.get("float32") else torch.float64)
    loss = spec.get("loss", "pair")
    said = io.StringIO()  # what rank 0 printed (start-up lines)
    with contextlib.ExitStack() as stack:
        stack.enter_context(contextlib.redirect_stdout(said))
        if spec.get("undone_on_rank1"):
            stack.enter_context(_contiguous_on_rank1())
        metrics = {
            None: None,
            True: {"acc": mf.metrics.next_token_accuracy},
            "mean": {"acc": token_mean_accuracy},
        }[spec.get("metrics")]
        engine = mf.parallelize(
            model, spec.get("plan"), loss_fn=loss_of(spec["model"], loss), optimizer=zoo_optimizer,
            metrics=metrics, **spec.get("options", {}),
        )  # fmt: skip
        if spec.get("predict"):
            engine.predict(batch_of(spec["model"], loss, 0)[0])
        losses, accuracies = [], []
        if spec.get("retry"):
            with contextlib.suppress(mf.MeshfitError):
                engine.step(batch_of(spec["model"], loss, 0))
        if spec.get("evaluate_first"):
            losses.append(float(engine.evaluate(batch_of(spec["model"], loss, 5))))
            if spec["evaluate_first"] == "only":
                return {"losses": losses}
        for step in range(3):
            if spec.get("packed"):
                batch = packed_batch(step)
            elif spec.get("long_prompt"):
                batch = long_prompt_batch(step)
            elif spec.get("left_padded"):
                batch = left_padded_batch(step, first_whole=spec["left_padded"] == "first whole")
            else:
                batch = batch_of(spec["model"], loss, step)
            losses.append(float(engine.step(batch)))
            accuracies += [float(v) for v in engine.last_metrics.values()]
    state = engine.full_state_dict()
    return {"losses": losses, "state": state, "metrics": accuracies, "said": said.getvalue()}


def token_mean_accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token accuracy as a mean over the micro-batch's tokens (no pair)."""
    return (outputs.argmax(-1) == targets).double().mean()


def left_padded_batch(step: int, first_whole: bool) -> tuple[dict, torch.Tensor]:
    """A collator's rows padded on the left (padding_side="left"), -100 on the padding
    and each row's first token; `first_whole`: the first row has no padding (the cp
    probe's window then shows none)."""
    g = torch.Generator().manual_seed(93_000 + step)
    ids = torch.zeros(8, LENGTH, dtype=torch.long)
    labels = torch.full((8, LENGTH), -100)
    mask = torch.zeros(8, LENGTH, dtype=torch.long)
    for i in range(8):
        n = LENGTH if i == 0 and first_whole else int(torch.randint(4, LENGTH, (), generator=g))
        ids[i, LENGTH - n :] = torch.randint(1, VOCAB, (n,), generator=g)
        mask[i, LENGTH - n :] = 1
        labels[i, LENGTH - n + 1 :] = ids[i, LENGTH - n + 1 :]
    return {"input_ids": ids, "attention_mask": mask}, labels


def long_prompt_batch(step: int) -> tuple[dict, torch.Tensor]:
    """4 rows of 256 tokens (two windows of the cp=2 probe's 128), the first row's first
    200 labels -100 (a long prompt): its share's probe window must be the row's end,
    the other share's is its start."""
    g = torch.Generator().manual_seed(97_000 + step)
    ids = torch.randint(1, VOCAB, (4, 256), generator=g)
    labels = ids.clone()
    labels[0, :200] = -100
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, labels


def many_cp_runs(specs: list[dict]) -> list[dict]:
    from workers import runs_or_refusals

    return runs_or_refusals(cp_run, specs)


def documents(step: int, count: int = 12) -> list[list[int]]:
    g = torch.Generator().manual_seed(95_000 + step)
    return [
        torch.randint(1, VOCAB, (int(torch.randint(3, 9, (), generator=g)),), generator=g).tolist()
        for _ in range(count)
    ]


def packed_batch(step: int) -> dict:
    """8 rows of 16 tokens packed from short documents (mf.data.pack), the model's own
    loss: a dict with input_ids, position_ids and labels."""
    rows = mf.data.pack(documents(step, 40), LENGTH)[:8]
    return mf.data.stack(rows)


@contextlib.contextmanager
def _contiguous_on_rank1():
    import os
    from unittest import mock

    from meshfit.parallel.context import chunks

    if os.environ.get("RANK") != "1":
        yield
        return

    def contiguous(length: int, cp: int, rank: int, device: torch.device) -> torch.Tensor:
        share = length // cp
        return torch.arange(rank * share, (rank + 1) * share, device=device)

    with mock.patch.object(chunks, "local_positions", contiguous):
        import meshfit.parallel.context as context

        with mock.patch.object(context, "local_positions", contiguous):
            yield


def gpt_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """meshfit's GPT's token mean (a module function: verify sends it to its workers)."""
    return F.cross_entropy(outputs.flatten(0, 1), targets.flatten())


def cp_save_then_resume(path: str, plan: str | None, save: bool) -> list[float]:
    """meshfit's GPT: 2 steps then a save (save=True), or a load of that checkpoint and
    its third step (save=False), under `plan`."""
    torch.manual_seed(1234)
    engine = mf.parallelize(meshfit_gpt().double(), plan, loss_fn=gpt_loss, optimizer=zoo_optimizer)
    if save:
        losses = [float(engine.step(batch_of("gpt", "pair", step))) for step in range(2)]
        engine.save(path)
        return losses
    engine.load(path)
    return [float(engine.step(batch_of("gpt", "pair", 2)))]
