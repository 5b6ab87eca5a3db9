"""The model zoo: model families people bring, built from their libraries' own configs
(nothing downloaded), each with a batch in the form its library yields and the loss it
is trained with. Dropout is off in every config: with it on, no two runs share random
numbers, in one process or many.

Sources: Hugging Face transformers (causal LMs, an encoder-decoder, a masked-LM encoder,
a vision transformer, mixtures of experts, per-head q/k norms, a state-space model
(Mamba), a speech encoder-decoder (Whisper), a channels-last CNN (ConvNeXt)), peft LoRA, Keras 3 (torch
backend), torchvision-style vision code (BatchNorm CNNs, a ResNet whose stages differ in
width), nanoGPT's model.py as people copy it (tests/nanogpt.py) and meshfit's own.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from workers import LM_LEN, LM_VOCAB

import meshfit as mf

VOCAB, LENGTH = LM_VOCAB, LM_LEN  # as the language-model tests' batches


@dataclass
class Family:
    build: Callable[[], nn.Module]
    batch: Callable[[int, int], Any]  # (batch size, step) -> a batch
    loss: Callable[[], Any]  # -> loss_fn
    dtype: str = "float64"
    options: dict | None = None  # parallelize options the family needs (blocks=...)


def _lm_batch(batch: int, step: int, masked_lm: bool = False) -> tuple[dict, torch.Tensor]:
    """A collator's batch: right-padded ids with their mask, -100 where no loss is
    taken (the prompt and padding for a causal LM; unmasked tokens for a masked LM)."""
    g = torch.Generator().manual_seed(30_000 + step)
    ids = torch.zeros(batch, LENGTH, dtype=torch.long)
    mask = torch.zeros(batch, LENGTH, dtype=torch.long)
    labels = torch.full((batch, LENGTH), -100)
    for i in range(batch):
        n = int(torch.randint(4, LENGTH + 1, (), generator=g))
        ids[i, :n] = torch.randint(1, VOCAB, (n,), generator=g)
        mask[i, :n] = 1
        if masked_lm:
            chosen = torch.rand(n, generator=g) < 0.3
            chosen[0] = True
            labels[i, :n][chosen] = ids[i, :n][chosen]
            ids[i, :n][chosen] = 1  # the [MASK] id
        else:
            prompt = int(torch.randint(1, n - 1, (), generator=g))
            labels[i, prompt:n] = ids[i, prompt:n]
    return {"input_ids": ids, "attention_mask": mask}, labels


def _images(batch: int, step: int, size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(40_000 + step)
    return torch.randn(batch, 3, size, size, generator=g) * 2 + 1, torch.randint(
        0, 5, (batch,), generator=g
    )


def _logits_loss(outputs: Any, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(getattr(outputs, "logits", outputs), targets)


# ---- transformers --------------------------------------------------------------------
def _lm(kind: str) -> nn.Module:
    """A language model of workers.build_lm (the same small configs as the LM tests)."""
    from workers import build_lm

    return build_lm(kind)


def hf_llama() -> nn.Module:  # grouped-query attention: 4 heads, 2 key/value heads
    from transformers import LlamaForCausalLM
    from workers import llama_config

    return LlamaForCausalLM(llama_config(num_hidden_layers=2, max_position_embeddings=LENGTH))


def peft_lora_llama() -> nn.Module:  # peft's LoRA adapters on q and v; the base frozen
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    return get_peft_model(hf_llama(), config)


def hf_gpt2() -> nn.Module:  # Conv1D projections, fused q/k/v, tied LM head
    return _lm("gpt2")


def hf_gpt_neox() -> nn.Module:  # q/k/v fused per head
    return _lm("neox")


def hf_mixtral() -> nn.Module:  # mixture of experts: 4 experts, 2 per token
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(
        MixtralConfig(
            vocab_size=VOCAB,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=LENGTH,
        )
    )


def hf_falcon() -> nn.Module:  # multi-query, attention and MLP in parallel, `mlp += attn`
    from transformers import FalconConfig, FalconForCausalLM

    config = FalconConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        multi_query=True, parallel_attn=True, new_decoder_architecture=False, bias=False,
        alibi=False, max_position_embeddings=LENGTH,
    )  # fmt: skip
    return FalconForCausalLM(config)


def hf_opt() -> nn.Module:  # final_layer_norm registered before the layers, run after
    from transformers import OPTConfig, OPTForCausalLM

    return OPTForCausalLM(
        OPTConfig(
            vocab_size=VOCAB,
            hidden_size=16,
            word_embed_proj_dim=16,
            ffn_dim=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=LENGTH,
            dropout=0.0,  # as the other families: the runs compare without random masks
            attention_dropout=0.0,
        )
    )


def hf_qwen3() -> nn.Module:  # per-head q_norm / k_norm, shared by all heads
    return _lm("qwen3")


def hf_qwen3_moe() -> nn.Module:  # the same attention, a mixture of experts' MLP
    return _lm("qwen3_moe")


def hf_t5() -> nn.Module:  # encoder-decoder: two stacks
    return _lm("t5")


def _t5_batch(batch: int, step: int) -> tuple[dict, torch.Tensor]:
    inputs, labels = _lm_batch(batch, step)
    decoder_ids = torch.zeros_like(labels)
    decoder_ids[:, 1:] = labels[:, :-1].clamp_min(0)
    return {**inputs, "decoder_input_ids": decoder_ids}, labels


def hf_bert() -> nn.Module:  # a masked-LM encoder; its decoder is tied to the embedding
    return _lm("bert")


def hf_vit() -> nn.Module:  # a vision transformer classifier
    from transformers import ViTConfig, ViTForImageClassification

    return ViTForImageClassification(
        ViTConfig(
            image_size=8,
            patch_size=4,
            num_channels=3,
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=32,
            num_labels=5,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
    )


def _vit_batch(batch: int, step: int) -> tuple[dict, torch.Tensor]:
    images, labels = _images(batch, step)
    return {"pixel_values": images}, labels


def hf_dinov2() -> nn.Module:  # its mask_token: used for masked pretraining, not here
    from transformers import Dinov2Config, Dinov2ForImageClassification

    config = Dinov2Config(
        image_size=16, patch_size=4, hidden_size=16, num_hidden_layers=2,
        num_attention_heads=4, mlp_ratio=2, num_labels=5, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, drop_path_rate=0.0,
    )  # fmt: skip
    return Dinov2ForImageClassification(config)


def hf_segformer() -> nn.Module:  # efficient attention: keys from a reduced sequence
    from transformers import SegformerConfig, SegformerForImageClassification

    config = SegformerConfig(
        num_channels=3, hidden_sizes=[8, 16], depths=[1, 1], num_encoder_blocks=2,
        sr_ratios=[2, 1], num_attention_heads=[1, 2], patch_sizes=[7, 3], strides=[4, 2],
        mlp_ratios=[2, 2], num_labels=5, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, drop_path_rate=0.0, classifier_dropout_prob=0.0,
    )  # fmt: skip
    return SegformerForImageClassification(config)


def hf_qwen2_moe() -> nn.Module:  # experts as nn.Linear per expert, and a shared expert
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    return Qwen2MoeForCausalLM(
        Qwen2MoeConfig(
            vocab_size=VOCAB,
            hidden_size=16,
            intermediate_size=32,
            moe_intermediate_size=8,
            shared_expert_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=2,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=LENGTH,
        )
    )


def hf_mamba() -> nn.Module:  # a state-space model: no attention, a causal conv and a scan
    from transformers import MambaConfig, MambaForCausalLM

    return MambaForCausalLM(
        MambaConfig(vocab_size=VOCAB, hidden_size=16, state_size=4, num_hidden_layers=2, expand=2)
    )


def hf_whisper() -> nn.Module:  # speech encoder-decoder: log-mel features in, tokens out
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    return WhisperForConditionalGeneration(
        WhisperConfig(
            vocab_size=VOCAB,
            num_mel_bins=8,
            d_model=16,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=32,
            decoder_ffn_dim=32,
            max_source_positions=8,
            max_target_positions=LENGTH,
            pad_token_id=0,
            decoder_start_token_id=1,
            eos_token_id=2,
            bos_token_id=1,
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
        )
    )


def _whisper_batch(batch: int, step: int) -> tuple[dict, torch.Tensor]:
    """As transformers' speech collator yields it: log-mel input_features (batch, mel
    bins, 2 x max_source_positions frames), decoder ids shifted right from the labels
    (-100 padding)."""
    g = torch.Generator().manual_seed(60_000 + step)
    features = torch.randn(batch, 8, 16, generator=g)
    _, labels = _lm_batch(batch, step)
    decoder_ids = torch.ones_like(labels)  # decoder_start_token_id
    decoder_ids[:, 1:] = labels[:, :-1].clamp_min(0)
    return {"input_features": features, "decoder_input_ids": decoder_ids}, labels


def hf_moonshine() -> nn.Module:  # speech seq2seq: raw audio in, its own token loss
    from transformers import MoonshineConfig, MoonshineForConditionalGeneration

    return MoonshineForConditionalGeneration(
        MoonshineConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            encoder_num_hidden_layers=2,
            decoder_num_hidden_layers=2,
            encoder_num_attention_heads=4,
            decoder_num_attention_heads=4,
            max_position_embeddings=64,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            decoder_start_token_id=1,
        )
    )


def _moonshine_batch(batch: int, step: int) -> dict:
    """As a speech collator yields it: raw audio (input_values, 1,600 samples) with its
    attention_mask, and the transcripts' labels (-100 after each one's end: lengths
    differ). The model makes its decoder's inputs from the labels and passes them to
    its loss as `shift_labels`, unshifted."""
    g = torch.Generator().manual_seed(70_000 + step)
    labels = torch.randint(3, VOCAB, (batch, 12), generator=g)
    for i, n in enumerate(torch.randint(3, 13, (batch,), generator=g).tolist()):
        labels[i, n:] = -100
    audio = torch.randn(batch, 1600, generator=g)
    return {
        "input_values": audio,
        "attention_mask": torch.ones(batch, 1600, dtype=torch.long),
        "labels": labels,
    }


def hf_convnext() -> nn.Module:  # a CNN with channels-last LayerNorms in its blocks
    from transformers import ConvNextConfig, ConvNextForImageClassification

    return ConvNextForImageClassification(
        ConvNextConfig(
            num_channels=3,
            patch_size=2,
            num_stages=2,
            hidden_sizes=[8, 16],
            depths=[2, 2],
            num_labels=5,
            image_size=8,
            drop_path_rate=0.0,
        )
    )


# ---- losses that couple the samples of a batch -------------------------------------------
def hf_qwen3_moe_aux() -> nn.Module:  # its load-balancing loss on, as MoE fine-tunes train it
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(
        Qwen3MoeConfig(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=4,
            max_position_embeddings=LENGTH, moe_intermediate_size=8, num_experts=4,
            num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.02,
        )
    )  # fmt: skip


def hf_mixtral_aux() -> nn.Module:  # as hf_mixtral, its load-balancing loss on
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(
        MixtralConfig(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, num_local_experts=4,
            num_experts_per_tok=2, max_position_embeddings=LENGTH,
            output_router_logits=True, router_aux_loss_coef=0.02,
        )
    )  # fmt: skip


def _lm_labels_batch(batch: int, step: int) -> dict:
    """A collator's dict with the labels in it: what loss_fn="model" trains on."""
    inputs, labels = _lm_batch(batch, step)
    return {**inputs, "labels": labels}


def _text_and_images(batch: int, step: int) -> dict:
    """As CLIPProcessor yields a batch (captions padded, pixel values), with return_loss:
    the model's own contrastive loss over every caption against every image."""
    g = torch.Generator().manual_seed(80_000 + step)
    inputs, _ = _lm_batch(batch, step)
    return {**inputs, "pixel_values": torch.randn(batch, 3, 8, 8, generator=g), "return_loss": True}


def hf_clip() -> nn.Module:  # contrastive: text x image similarities over the batch
    from transformers import CLIPConfig, CLIPModel

    towers = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2)
    return CLIPModel(
        CLIPConfig(
            text_config=dict(vocab_size=VOCAB, max_position_embeddings=LENGTH, **towers),
            vision_config=dict(image_size=8, patch_size=4, **towers),
            projection_dim=8,
        )
    )


def hf_siglip() -> nn.Module:  # pairwise sigmoid loss over every text and image of the batch
    from transformers import SiglipConfig, SiglipModel

    towers = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2)
    return SiglipModel(
        SiglipConfig(
            text_config=dict(vocab_size=VOCAB, max_position_embeddings=LENGTH, **towers),
            vision_config=dict(image_size=8, patch_size=4, **towers),
        )
    )


class SentencePairs(nn.Module):
    """A sentence-embedding model as sentence-transformers builds one: a transformers
    encoder and mean pooling over the real tokens, called on (anchor, positive) pairs."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import BertConfig, BertModel

        self.encoder = BertModel(
            BertConfig(
                vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                intermediate_size=32, max_position_embeddings=LENGTH, hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
            ),
            add_pooling_layer=False,
        )  # fmt: skip

    def embed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        states = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(states.dtype)
        return (states * mask).sum(1) / mask.sum(1).clamp(min=1e-9)

    def forward(self, anchor_ids, anchor_mask, positive_ids, positive_mask) -> tuple:
        return self.embed(anchor_ids, anchor_mask), self.embed(positive_ids, positive_mask)


def _sentence_pairs(batch: int, step: int) -> tuple[dict, torch.Tensor]:
    anchor, _ = _lm_batch(batch, step)
    positive, _ = _lm_batch(batch, step + 1000)
    inputs = {
        "anchor_ids": anchor["input_ids"], "anchor_mask": anchor["attention_mask"],
        "positive_ids": positive["input_ids"], "positive_mask": positive["attention_mask"],
    }  # fmt: skip
    return inputs, torch.arange(batch)  # the targets: each anchor's own positive


def _in_batch_negatives(outputs: tuple, _targets: torch.Tensor) -> torch.Tensor:
    """sentence-transformers' MultipleNegativesRankingLoss as its code writes it: cosine
    similarity of every anchor to every positive in the batch (util.cos_sim:
    torch.mm(a, b.transpose(0, 1)) of the normalised embeddings), scaled by 20, each
    anchor's own positive the right answer."""
    a, b = outputs
    scores = torch.mm(F.normalize(a, p=2, dim=1), F.normalize(b, p=2, dim=1).transpose(0, 1))
    labels = torch.arange(len(scores), dtype=torch.long, device=scores.device)
    return F.cross_entropy(scores * 20.0, labels)


# ---- diffusers ---------------------------------------------------------------------------
def diffusers_unet() -> nn.Module:  # a conditional UNet: skip connections down to up
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(8, 16), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=8,
        attention_head_dim=2, norm_num_groups=4,
    )  # fmt: skip


def _unet_batch(batch: int, step: int) -> tuple[dict, torch.Tensor]:
    """As a diffusion training loop makes them: noisy latents, a timestep per sample
    and the text encoder's states; the target is the noise added."""
    g = torch.Generator().manual_seed(70_000 + step)
    inputs = {
        "sample": torch.randn(batch, 4, 8, 8, generator=g),
        "timestep": torch.randint(0, 1000, (batch,), generator=g),
        "encoder_hidden_states": torch.randn(batch, 5, 8, generator=g),
    }
    return inputs, torch.randn(batch, 4, 8, 8, generator=g)


def _noise_loss(outputs: Any, noise: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(outputs.sample, noise)


def hf_resnet() -> nn.Module:  # BatchNorm CNN; its main input, pixel_values, not token ids
    from transformers import ResNetConfig, ResNetForImageClassification

    config = ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 2], layer_type="basic", num_labels=5
    )
    return ResNetForImageClassification(config)


def hf_resnet_bottleneck() -> nn.Module:  # ResNet-50's layer type, its default
    from transformers import ResNetConfig, ResNetForImageClassification

    config = ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=5)
    return ResNetForImageClassification(config)


def hf_yolos() -> nn.Module:  # ViT with detection tokens; DETR's loss
    from transformers import YolosConfig, YolosForObjectDetection

    config = YolosConfig(
        image_size=[16, 16], patch_size=4, hidden_size=16, num_hidden_layers=4,
        num_attention_heads=4, intermediate_size=32, num_detection_tokens=5, num_labels=4,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return YolosForObjectDetection(config)


def hf_detr() -> nn.Module:  # a ResNet backbone (transformers'), its decoder's aux losses
    from transformers import DetrConfig, DetrForObjectDetection, ResNetConfig

    backbone = ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], out_features=["stage2"]
    )
    config = DetrConfig(
        use_timm_backbone=False, backbone_config=backbone, use_pretrained_backbone=False,
        d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, num_queries=5,
        num_labels=4, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        auxiliary_loss=True,
    )  # fmt: skip
    return DetrForObjectDetection(config)


def _detection_batch(batch: int, step: int) -> dict:
    """An object-detection collator's batch: the images, and `labels` a list of one dict
    per image of its boxes (1-3: counts differ) and their classes, as transformers'
    image processors yield them (boxes as normalised centre, width, height)."""
    g = torch.Generator().manual_seed(60_000 + step)
    labels = []
    for _ in range(batch):
        n = int(torch.randint(1, 4, (), generator=g))
        centres = torch.rand(n, 2, generator=g) * 0.5 + 0.25
        sizes = torch.rand(n, 2, generator=g) * 0.3 + 0.1
        classes = torch.randint(0, 4, (n,), generator=g)
        labels.append({"class_labels": classes, "boxes": torch.cat([centres, sizes], 1)})
    return {"pixel_values": torch.randn(batch, 3, 16, 16, generator=g), "labels": labels}


def hf_qwen2_vl() -> nn.Module:  # a vision tower whose patches the batch packs
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    text = dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]},
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    vision = dict(
        depth=2, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=2,
        spatial_merge_size=2, temporal_patch_size=1, in_channels=3,
    )  # fmt: skip
    config = Qwen2VLConfig(
        text_config=text, vision_config=vision, image_token_id=60, video_token_id=61,
        vision_start_token_id=62, vision_end_token_id=63,
    )  # fmt: skip
    return Qwen2VLForConditionalGeneration(config)


# each sample's images as (h, w) patches (merged 2 x 2 into h * w / 4 tokens): counts and
# sizes differ, as a processor packs them
_QWEN2_VL_IMAGES = [[(4, 4), (2, 4)], [(2, 2)], [(4, 2)], [(4, 4)]]


def _qwen2_vl_batch(batch: int, step: int, text_only: tuple[int, ...] = ()) -> dict:
    """Qwen2-VL's processor's batch: the text with each image's tokens between its
    start and end marks, `mm_token_type_ids` marking them, `pixel_values` packing every
    image's patches (one row each) and `image_grid_thw` one row per image; labels -100
    on the prompt (12-18 tokens: the samples' counts of labels differ). The samples
    `text_only` hold no image."""
    g = torch.Generator().manual_seed(70_000 + step)
    ids = torch.randint(1, 59, (batch, 24), generator=g)
    grids, patches = [], []
    for i in range(batch):
        at = 1
        for h, w in [] if i in text_only else _QWEN2_VL_IMAGES[i % len(_QWEN2_VL_IMAGES)]:
            tokens = h * w // 4
            ids[i, at], ids[i, at + 1 + tokens] = 62, 63
            ids[i, at + 1 : at + 1 + tokens] = 60
            at += tokens + 2
            grids.append([1, h, w])
            patches.append(torch.randn(h * w, 12, generator=g))
    labels = ids.clone()
    for i in range(batch):  # prompts of other lengths: each sample's own count of labels
        labels[i, : 12 + 3 * (i % 3)] = -100
    return {
        "input_ids": ids, "attention_mask": torch.ones_like(ids),
        "mm_token_type_ids": (ids == 60).long(), "pixel_values": torch.cat(patches),
        "image_grid_thw": torch.tensor(grids), "labels": labels,
    }  # fmt: skip


def _pixel_batch(batch: int, step: int) -> tuple[dict, torch.Tensor]:
    images, labels = _images(batch, step, size=16)
    return {"pixel_values": images}, labels


# ---- torchvision-style vision code -----------------------------------------------------
class BasicBlock(nn.Module):
    """torchvision's ResNet BasicBlock, small: conv-BN-ReLU-conv-BN plus a shortcut
    (a 1x1 conv where the width changes)."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Conv2d(cin, cout, 1, bias=False) if cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class SmallResNet(nn.Module):
    """A ResNet whose stages differ in width (8, 8, 16, 16 channels)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8))
        widths = [8, 8, 16, 16]
        self.layers = nn.Sequential(
            *(BasicBlock(a, b) for a, b in zip([8, *widths[:-1]], widths, strict=True))
        )
        self.fc = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(F.relu(self.stem(x)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


# ---- nanoGPT, as people copy its model.py -------------------------------------------------
def nanogpt() -> nn.Module:
    from nanogpt import GPT, GPTConfig

    return GPT(GPTConfig(block_size=LENGTH, vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=16))


def _nanogpt_batch(batch: int, step: int) -> tuple[dict, torch.Tensor]:
    """As nanoGPT's get_batch makes them: random crops of a token stream, the targets
    the next tokens; the model takes both and returns (logits, loss)."""
    g = torch.Generator().manual_seed(60_000 + step)
    data = torch.randint(0, VOCAB, (batch, LENGTH + 1), generator=g)
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    return {"idx": x, "targets": y}, y


def _nanogpt_loss(outputs: tuple, targets: torch.Tensor) -> torch.Tensor:
    return outputs[1]  # the loss nanoGPT's forward computed from targets


# nanoGPT's attention cuts q|k|v at n_embd, the whole width, so tp cannot split it: the
# trial on meta keeps it whole, and without the trial the refusal names this plan
NANOGPT_MLP_PLAN = {"transformer.h.*.mlp.c_fc": "colwise", "transformer.h.*.mlp.c_proj": "rowwise"}


# ---- timm's VisionTransformer, as timm writes it (tests/timm_vit.py) ----------------------
def timm_vit() -> nn.Module:
    from timm_vit import VisionTransformer

    return VisionTransformer(
        img_size=8, patch_size=4, num_classes=5, embed_dim=16, depth=2, num_heads=2,
        mlp_ratio=2.0, init_values=0.1,
    )  # fmt: skip


# ---- Keras 3 ---------------------------------------------------------------------------
def timm_convnext() -> nn.Module:  # blocks inside stages (tests/timm_convnext.py)
    from timm_convnext import convnext_atto

    return convnext_atto(num_classes=5, depths=(2, 2), dims=(8, 16), ls_init_value=0.5)


def keras_mlp() -> nn.Module:
    os.environ.setdefault("KERAS_BACKEND", "torch")
    import keras

    keras.utils.set_random_seed(1234)
    return keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(32, activation="tanh"),
            keras.layers.Dense(32, activation="tanh"),
            keras.layers.Dense(5),
        ]
    )


def _vectors(batch: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(50_000 + step)
    return torch.randn(batch, 8, generator=g), torch.randint(0, 5, (batch,), generator=g)


def _own(kind: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from workers import _build

        return _build(kind)[0]

    return build


def _own_batch(kind: str) -> Callable[[int, int], Any]:
    def batch(size: int, step: int) -> Any:
        from workers import make_batch

        return make_batch(kind, size, step)

    return batch


def _causal() -> Any:
    return mf.losses.cross_entropy(shift=True)


def _masked() -> Any:
    return mf.losses.cross_entropy()


def _own_loss(kind: str) -> Callable[[], Any]:
    def loss() -> Any:
        from workers import _build

        return _build(kind)[1]

    return loss


FAMILIES: dict[str, Family] = {
    "llama": Family(hf_llama, _lm_batch, _causal),
    "lora_llama": Family(peft_lora_llama, _lm_batch, _causal),
    "gpt2": Family(hf_gpt2, _lm_batch, _causal),
    "gpt_neox": Family(hf_gpt_neox, _lm_batch, _causal),
    # float32: its experts run on torch._grouped_mm, which takes no float64
    "mixtral": Family(hf_mixtral, _lm_batch, _causal, dtype="float32"),
    "qwen3": Family(hf_qwen3, _lm_batch, _causal),
    "qwen3_moe": Family(hf_qwen3_moe, _lm_batch, _causal, dtype="float32"),  # as mixtral
    "t5": Family(hf_t5, _t5_batch, _masked),
    "opt": Family(hf_opt, _lm_batch, _causal),
    "falcon": Family(hf_falcon, _lm_batch, _causal),
    "bert": Family(hf_bert, lambda b, s: _lm_batch(b, s, masked_lm=True), _masked),
    "vit": Family(hf_vit, _vit_batch, lambda: _logits_loss),
    "resnet": Family(SmallResNet, _images, lambda: F.cross_entropy),
    "bn_cnn": Family(_own("bn_cnn"), _own_batch("bn_cnn"), _own_loss("bn_cnn")),
    "keras_mlp": Family(keras_mlp, _vectors, lambda: F.cross_entropy, dtype="float32"),
    "gpt": Family(_own("gpt4"), _own_batch("gpt4"), _own_loss("gpt4")),
    "nanogpt": Family(nanogpt, _nanogpt_batch, lambda: _nanogpt_loss),
    "timm_vit": Family(timm_vit, _images, lambda: F.cross_entropy),
    "timm_convnext": Family(timm_convnext, _images, lambda: F.cross_entropy),
    "qwen2_moe": Family(hf_qwen2_moe, _lm_batch, _causal, dtype="float32"),  # as mixtral
    # float32: its blocks keep the residual stream in float32 (residual_in_fp32)
    "mamba": Family(hf_mamba, _lm_batch, _causal, dtype="float32"),
    "whisper": Family(hf_whisper, _whisper_batch, _masked),
    # its own loss: transformers' causal-LM loss given the labels as `shift_labels`
    # (counted unshifted: losses.py), summed over the global count; float32: that loss
    # computes in float32 (`logits.float()`) whatever the model's dtype
    "moonshine": Family(hf_moonshine, _moonshine_batch, lambda: "model", dtype="float32"),
    "convnext": Family(hf_convnext, _vit_batch, lambda: _logits_loss),
    # a parameter its loss never uses (mask_token): DDP rebuilt to find it at the first step
    "dinov2": Family(hf_dinov2, _pixel_batch, lambda: _logits_loss),
    # the blocks meshfit finds are the 3 convolutions inside its one bottleneck, whose
    # input is added back after them: pp refused (before, 7% apart from one process)
    "resnet_bottleneck": Family(hf_resnet_bottleneck, _pixel_batch, lambda: _logits_loss),
    # object detection: each image's boxes in a list, and a loss over the batch's boxes
    # (matched per image, divided by the batch's box count and class weights), formed
    # over the gathered batch (coupling/own_loss.py); float32: the loss's class weights
    "yolos": Family(hf_yolos, _detection_batch, lambda: "model", dtype="float32"),
    "detr": Family(hf_detr, _detection_batch, lambda: "model", dtype="float32"),
    "titan": Family(
        _own("titan"), _own_batch("titan"), _own_loss("titan"), options={"blocks": "layers"}
    ),
    # losses that couple the samples of a batch (coupling/): the model's own contrastive
    # loss, in-batch negatives in the loss_fn, load-balancing losses over the batch
    "clip": Family(hf_clip, _text_and_images, lambda: "model"),
    "siglip": Family(hf_siglip, _text_and_images, lambda: "model"),
    "sentence_pairs": Family(SentencePairs, _sentence_pairs, lambda: _in_batch_negatives),
    # float32 (torch._grouped_mm takes no float64), as mixtral and qwen3_moe
    "qwen3_moe_aux": Family(hf_qwen3_moe_aux, _lm_labels_batch, lambda: "model", dtype="float32"),
    "mixtral_aux": Family(hf_mixtral_aux, _lm_labels_batch, lambda: "model", dtype="float32"),
}


# Families outside the matrix: diffusers' UNet (its skip connections run from every
# down block to an up block, so no pipeline cut exists: tested on its own)
OTHERS: dict[str, Family] = {
    "unet": Family(diffusers_unet, _unet_batch, lambda: _noise_loss),
    # transformers' ResNet: the engine's build on its first batch (test_model_zoo)
    "hf_resnet": Family(hf_resnet, _pixel_batch, lambda: _logits_loss),
    # a vision-language model whose batch packs every image's patches in one tensor
    # (trees.PACKED): split by each sample's images (test_model_zoo; outside the matrix:
    # its tp split as derived fails in the vision attention, which the planner does not
    # foresee); float32, as its vision tower computes its rotary embedding
    "qwen2_vl": Family(hf_qwen2_vl, _qwen2_vl_batch, lambda: "model", dtype="float32"),
    "qwen2_vl_text_only": Family(
        hf_qwen2_vl,
        lambda b, s: _qwen2_vl_batch(b, s, text_only=(2, 3)),
        lambda: "model",
        dtype="float32",
    ),  # fmt: skip
    # SegFormer: its tp split as derived fails inside DTensor (test_model_zoo)
    "segformer": Family(hf_segformer, _pixel_batch, lambda: _logits_loss),
}


# Spec flags that replace a step of tp's derivation (derive.<name>) for a control run:
# BatchNorm left unsplit between the CNN's split convolutions; no trial on meta (split,
# then checked).
_CONTROLS = {
    "batchnorm_whole": ("_channel_layers", lambda *a: {}),
    "no_trial": ("keep_whole_what_cannot_split", lambda *a: None),
}


def zoo_run(spec: dict) -> dict:
    """Train family `spec["model"]` under `spec["plan"]` for 3 SGD steps on batches of
    8; its losses and final weights (a Keras model's by position: Keras names layers
    from a process-wide counter)."""
    family = FAMILIES.get(spec["model"]) or OTHERS[spec["model"]]
    torch.manual_seed(1234)
    dtype = getattr(torch, family.dtype)
    if spec.get("meta"):  # built on meta in its dtype, as a user builds a large model
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device("meta"):
                model = family.build()
        finally:
            torch.set_default_dtype(default)
    else:
        model = family.build().to(dtype)

    def batch(step: int) -> Any:
        made = family.batch(8, step)
        in_dtype = lambda t: t.to(dtype) if t.is_floating_point() else t  # noqa: E731
        if isinstance(made, dict):  # the model's own loss: the mapping it takes
            return mf.trees.map_tensors(made, in_dtype)
        inputs, targets = made
        return mf.trees.map_tensors(inputs, in_dtype), targets

    # As fit does: an example micro-batch, on which pp times the blocks (and checks the
    # cut before any rank trains); the model's own loss: its mapping, labels included
    # (Moonshine makes its decoder's inputs from them).
    first = batch(0)
    first = first if isinstance(first, dict) else first[0]
    example = mf.trees.slice_rows(first, 0, 2)  # (packed images: by sample)
    loss_fn = family.loss()
    if "grad_scale" in spec:  # the negative control: a deliberately wrong gradient
        from workers import scaled_gradient

        loss_fn = scaled_gradient(loss_fn, spec["grad_scale"])
    with contextlib.ExitStack() as stack:
        if spec.get("experts_as_one_block"):  # the negative control of the experts' split
            stack.enter_context(_experts_split_as_one_block())
        for flag, (name, stand_in) in _CONTROLS.items():
            if spec.get(flag):
                from unittest import mock

                from meshfit.parallel.tensor import derive

                stack.enter_context(mock.patch.object(derive, name, stand_in))
        engine = mf.parallelize(
            model,
            spec.get("plan"),
            loss_fn=loss_fn,
            optimizer=zoo_optimizer,
            example_inputs=None if spec.get("no_example") else example,
            **(family.options or {}),
            **spec.get("options", {}),
        )
    if spec.get("no_example") == "made up":  # read before any batch: built on a made-up one
        engine.runner  # noqa: B018
    losses = [float(engine.step(batch(step))) for step in range(3)]
    if spec.get("save"):  # a sharded checkpoint, loaded back by the test in one process
        engine.save(spec["save"])
    state = engine.full_state_dict()
    if spec["model"].startswith("keras"):
        state = keras_state_by_position(model, state)
    result = {"losses": losses, "state": state}
    if engine.plan.tp > 1:  # what fit's start-up line says tp split
        result["tp_split"] = engine.tp_report and engine.tp_report.describe()
    return result


def keras_state_by_position(model: nn.Module, state: dict) -> dict:
    """A Keras model's state keyed by its variables' order (`model.weights`), not by
    their paths: Keras names layers from a process-wide counter ("dense_9", "dense_10"),
    and torch's ParameterDict sorts the paths, so the order of the state's keys depends
    on how many layers the process made before (one Keras model more in the suite made
    a worker's order and the test process's differ)."""
    order = {v.path: i for i, v in enumerate(model.weights)}
    out = {}
    for key, value in state.items():
        index = order.get(key.rpartition("_torch_params.")[2])
        if index is not None:
            out.setdefault(str(index), value)
    assert len(out) == len(order), (sorted(state), sorted(order))
    return out


def zoo_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


@contextlib.contextmanager
def _experts_split_as_one_block() -> Iterator[None]:
    """A deliberately wrong tp split of a mixture of experts: the fused gate|up weight
    split as one block (rank 0 all of gate, rank 1 all of up) instead of per chunk."""
    from unittest import mock

    from meshfit.parallel.tensor import apply

    derived = apply._weight_styles

    def one_block(derivation: Any) -> dict:
        styles = derived(derivation)
        for style in styles.values():
            style.weights = {n: (k, d, 1) for n, (k, d, _) in style.weights.items()}
        return styles

    with mock.patch.object(apply, "_weight_styles", one_block):
        yield


def many_zoo_runs(specs: list[dict]) -> list[dict]:
    """zoo_run for each spec, refusals kept (workers.runs_or_refusals)."""
    from workers import runs_or_refusals

    return runs_or_refusals(zoo_run, specs)
