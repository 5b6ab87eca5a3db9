"""Batches whose samples are not only rows of tensors, as libraries' collators yield them
(meshfit/trees.py): a list of one item per sample under a key (an object detector's
`labels`, one dict of boxes per image) and packed images (Qwen2-VL's `pixel_values`, one
row per patch of every image, with `image_grid_thw`). Each is split with the batch by
sample; the worker runs are in test_model_zoo.py (YOLOS, DETR, Qwen2-VL)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from zoo import OTHERS, zoo_optimizer  # noqa: E402

import meshfit as mf  # noqa: E402
from meshfit.runtime.batches import batch_size  # noqa: E402
from meshfit.trees import batch_rows, packed_spans, slice_rows  # noqa: E402


def test_a_list_of_one_item_per_sample_splits_with_the_batch() -> None:
    """Split by its items, never by the tensors inside them; a list of another length is
    left as it is."""
    boxes = [{"boxes": torch.rand(n, 4)} for n in (1, 3, 2, 2)]
    batch = {"pixel_values": torch.randn(4, 3), "labels": boxes, "sizes": [7, 8]}
    assert batch_rows(batch) == 4 and batch_size(batch, "inputs") == 4
    part = slice_rows(batch, 1, 3)
    assert part["labels"] == boxes[1:3] and part["sizes"] == [7, 8]
    assert torch.equal(part["pixel_values"], batch["pixel_values"][1:3])
    with pytest.raises(mf.MeshfitError, match="disagree on the batch size"):
        batch_size({"pixel_values": torch.randn(4, 3), "mask": torch.ones(3)}, "inputs")


def _packed(images: list[list[int]]) -> dict:
    """A packed batch: sample i's images of images[i] patches each (merge 4: a token per
    4 patches), its tokens marked 1 in mm_token_type_ids."""
    types = torch.zeros(len(images), 8, dtype=torch.long)
    grids, rows = [], []
    for i, sizes in enumerate(images):
        types[i, : sum(sizes) // 4] = 1
        for size in sizes:
            grids.append([1, 2, size // 2])
            rows.append(torch.full((size, 3), float(len(grids))))  # each image's number
    return {
        "input_ids": torch.zeros(len(images), 8, dtype=torch.long),
        "mm_token_type_ids": types,
        "pixel_values": torch.cat(rows),
        "image_grid_thw": torch.tensor(grids),
    }


def test_packed_images_split_by_the_images_of_each_sample() -> None:
    """Sample 0 has two images, sample 1 none, samples 2 and 3 one each (of other
    sizes): rows 1-3 hold images 3 and 4 with their patches; a part without images has
    neither key (as a processor yields text alone); counts that do not add up, or no
    mm_token_type_ids, are refused naming the fix."""
    batch = _packed([[8, 4], [], [4], [8]])
    assert batch_rows(batch) == 4 and batch_size(batch, "inputs") == 4
    assert packed_spans(batch)["pixel_values"] == [(0, 12), (12, 12), (12, 16), (16, 24)]
    part = slice_rows(batch, 2, 4)
    assert part["image_grid_thw"].tolist() == [[1, 2, 2], [1, 2, 4]]
    assert part["pixel_values"][:, 0].unique().tolist() == [3.0, 4.0]
    assert part["pixel_values"].shape[0] == 12 and part["input_ids"].shape[0] == 2
    assert set(slice_rows(batch, 1, 2)) == {"input_ids", "mm_token_type_ids"}
    del batch["mm_token_type_ids"]
    with pytest.raises(mf.MeshfitError, match="mm_token_type_ids, which the batch lacks"):
        batch_size(batch, "inputs")


def test_what_a_processor_gives_per_video_splits_with_the_videos() -> None:
    """Qwen2.5-VL's processor gives each video's seconds per temporal patch
    (`second_per_grid_ts`, one per video) beside `video_grid_thw`: split with the videos
    of each sample (before, the batch was refused as the user's: "the tensors in inputs
    disagree on the batch size"; with as many videos as samples, cut by rows)."""
    videos = _packed([[8], [4, 4], [8]])
    batch = {
        "input_ids": videos["input_ids"],
        "mm_token_type_ids": videos["mm_token_type_ids"] * 2,  # video tokens: type 2
        "pixel_values_videos": videos["pixel_values"],
        "video_grid_thw": videos["image_grid_thw"],
        "second_per_grid_ts": torch.tensor([0.5, 1.0, 2.0, 4.0]),
    }
    assert batch_rows(batch) == 3 and batch_size(batch, "inputs") == 3
    assert slice_rows(batch, 1, 2)["second_per_grid_ts"].tolist() == [1.0, 2.0]
    assert slice_rows(batch, 2, 3)["second_per_grid_ts"].tolist() == [4.0]
    as_list = slice_rows({**batch, "second_per_grid_ts": [0.5, 1.0, 2.0, 4.0]}, 0, 1)
    assert as_list["second_per_grid_ts"] == [0.5]


def test_qwen2_vl_trains_its_packed_batch_in_one_process_and_in_micro_batches() -> None:
    """One process refused Qwen2-VL's processor batch ("the tensors in inputs disagree on
    the batch size"); it trains now, and two micro-batches (each its samples' images and
    patches; the causal-LM loss counted over the whole batch) train the same run."""
    family = OTHERS["qwen2_vl"]

    def run(plan: str | None) -> list[float]:
        torch.manual_seed(0)
        engine = mf.parallelize(family.build(), plan, loss_fn="model", optimizer=zoo_optimizer)
        return [float(engine.step(family.batch(8, step))) for step in range(2)]

    assert run("microbatches=2") == pytest.approx(run(None), rel=1e-5)


def test_vision_language_models_count_as_causal_lms_and_seq2seq_ones_unshifted() -> None:
    """transformers gives both the loss_type "ForConditionalGeneration": Qwen2-VL calls
    the causal-LM loss on its labels (counted shifted, as a causal LM); Moonshine calls
    it with its labels as `shift_labels`, the targets as they stand (counted unshifted:
    before, it was left a mean per rank, another run under dp). Both are trained as a
    sum over the global count (the worker runs: the zoo's matrix)."""
    from transformers import MoonshineConfig, MoonshineForConditionalGeneration

    from meshfit.losses import ModelOwnLoss

    vlm = ModelOwnLoss(OTHERS["qwen2_vl"].build())
    assert vlm.sums and vlm.shifted
    config = MoonshineConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, encoder_num_hidden_layers=1,
        decoder_num_hidden_layers=1, encoder_num_attention_heads=2,
        decoder_num_attention_heads=2,
    )  # fmt: skip
    speech = ModelOwnLoss(MoonshineForConditionalGeneration(config))
    assert speech.sums and not speech.shifted and speech.deferred_head == "masked"
    labels = torch.tensor([[5, 6, 7, -100], [8, -100, -100, -100]])
    assert int(speech.count(labels)) == 4  # every label that is not -100, none shifted off


def test_pp_refuses_to_cut_such_a_batch_into_micro_batches() -> None:
    """torch's pipeline schedule cuts every input tensor by rows: a list of boxes per
    image would be cut box by box, packed images patch by patch. Refused by key, with
    the fix; one micro-batch cuts nothing."""
    from meshfit.plan import Plan
    from meshfit.runtime.batches import check_rows_cut_into_microbatches

    boxes = {"pixel_values": torch.randn(4, 3), "labels": [{"boxes": torch.rand(2, 4)}] * 4}
    for batch, keys in ((boxes, "'labels'"), (_packed([[4], [4], [8], [4]]), "'pixel_values'")):
        with pytest.raises(mf.MeshfitError, match=f"otherwise in {keys}") as refusal:
            check_rows_cut_into_microbatches(batch, Plan.parse("pp=2"), 4)
        assert "microbatches=1" in str(refusal.value)
    check_rows_cut_into_microbatches({"x": torch.randn(4, 3)}, Plan.parse("pp=2"), 4)
