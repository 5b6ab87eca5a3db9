"""Byte-level text from the Python standard library's own source: real text that every
Python installation ships, so the demo needs no download."""

from __future__ import annotations

import os
import sysconfig

import torch
from torch.utils.data import Dataset


def python_stdlib_text(max_bytes: int = 4_000_000) -> bytes:
    """Up to `max_bytes` of the standard library's .py files, concatenated in a fixed
    (sorted) order so every process and every run reads the same bytes."""
    root = sysconfig.get_paths()["stdlib"]
    chunks, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d
            for d in dirnames
            if d not in ("site-packages", "test", "tests", "__pycache__", "idlelib")
        )
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            try:
                with open(os.path.join(dirpath, name), "rb") as f:
                    data = f.read()
            except OSError:
                continue
            chunks.append(data)
            total += len(data)
            if total >= max_bytes:
                return b"".join(chunks)[:max_bytes]
    if not chunks:
        raise RuntimeError(f"found no Python source under {root!r} to use as demo text")
    return b"".join(chunks)


class ByteTextDataset(Dataset):
    """Non-overlapping windows of `block_size` bytes: sample i is (x, y) with y the
    bytes of x shifted by one (next-byte prediction)."""

    def __init__(self, data: bytes | torch.Tensor, block_size: int) -> None:
        if isinstance(data, bytes):
            data = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.data = data.to(torch.long)
        self.block_size = block_size
        self.length = (len(self.data) - 1) // block_size

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.length:
            raise IndexError(index)
        start = index * self.block_size
        window = self.data[start : start + self.block_size + 1]
        return window[:-1], window[1:]

    def split(self, holdout: float = 0.05) -> tuple[ByteTextDataset, ByteTextDataset]:
        """(train, validation) on disjoint byte ranges: the last `holdout` is held out."""
        cut = int(len(self.data) * (1 - holdout))
        return (
            ByteTextDataset(self.data[:cut], self.block_size),
            ByteTextDataset(self.data[cut:], self.block_size),
        )
