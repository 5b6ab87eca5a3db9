"""Checkpoint checksums: what hashing every file at save (and load) costs.

One process saves the same model and AdamW state `--repeats` times with checksums and
without (integrity.digests replaced by a no-op), and times `engine.load`, which verifies
them; also the raw hash speed of xxh3-64 and zlib's crc32 on the saved bytes.

    python benchmarks/checkpoint_integrity.py            # a 25M-parameter GPT (~300 MB)
    python benchmarks/checkpoint_integrity.py --quick    # smoke test: checks the script

Writes JSON to benchmarks/results/checkpoint-integrity-cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import zlib

import torch

import meshfit as mf
from meshfit.models import GPT, GPTConfig, next_token_loss
from meshfit.state import integrity


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    width, layers = (32, 1) if args.quick else (512, 8)
    config = GPTConfig(vocab_size=256, block_size=64, n_layer=layers, n_head=4, n_embd=width)
    engine = mf.parallelize(GPT(config), "dp=1", loss_fn=next_token_loss)
    tokens = torch.randint(0, 256, (4, 65))
    engine.step((tokens[:, :-1], tokens[:, 1:]))  # AdamW state exists
    repeats = 2 if args.quick else args.repeats
    work = tempfile.mkdtemp(prefix="meshfit-integrity-")
    real_digests = integrity.digests
    times: dict[str, list[float]] = {"save with checksums": [], "save without": [], "load": []}
    try:
        for i in range(repeats):
            for name in ("save with checksums", "save without"):
                path = os.path.join(work, f"{i}-{name.replace(' ', '-')}")
                integrity.digests = real_digests if "with" in name else (lambda root, files: {})
                times[name].append(_timed(lambda path=path: engine.save(path)))
            integrity.digests = real_digests
            verified = os.path.join(work, f"{i}-save-with-checksums")  # load verifies it
            times["load"].append(_timed(lambda verified=verified: engine.load(verified)))
        saved = os.path.join(work, "0-save-with-checksums")
        files = [os.path.join(saved, f) for f in integrity.checkpoint_files(saved)]
        size = sum(os.path.getsize(f) for f in files)
        blobs = [open(f, "rb").read() for f in files]
        xxh = _timed(lambda: [integrity.file_digest(f) for f in files])
        crc = _timed(lambda: [zlib.crc32(b) for b in blobs])
    finally:
        integrity.digests = real_digests
        shutil.rmtree(work, ignore_errors=True)
    medians = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "checkpoint_bytes": size,
        "repeats": repeats,
        "median_s": medians,
        "xxh3_GBps_from_disk": size / xxh / 1e9,
        "crc32_GBps_in_memory": size / crc / 1e9,
        "save_overhead": medians["save with checksums"] / medians["save without"] - 1,
    }
    out = args.out or os.path.join(
        os.path.dirname(os.path.abspath(__file__)),
        "results",
        f"checkpoint-integrity-cpu{'-quick' if args.quick else ''}.json",
    )
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"checkpoint {size / 1e6:.1f} MB, median of {repeats}; results in {out}")
    for name, value in medians.items():
        print(f"  {name:22s} {value:7.3f} s")
    print(
        f"  hash speed: xxh3-64 {result['xxh3_GBps_from_disk']:.2f} GB/s (from the page cache),"
        f" crc32 {result['crc32_GBps_in_memory']:.2f} GB/s (in memory)"
    )
    print(f"  save overhead of checksums: {100 * result['save_overhead']:+.1f}%")


if __name__ == "__main__":
    main()
