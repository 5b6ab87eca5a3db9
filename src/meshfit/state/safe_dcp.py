"""Reading DCP checkpoints without running code from them.

DCP would unpickle its metadata and any non-tensor values with full pickle; these
subclasses read metadata through an allow-list and values with weights_only=True.
Kept apart from checkpoint.py so that DCP is imported only when a checkpoint is read.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from meshfit.errors import MeshfitError

_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata, refusing anything but its plain data classes."""

    def find_class(self, module: str, name: str) -> Any:
        value = None
        if module in _DCP_MODULES:
            candidate = getattr(__import__(module, fromlist=[name]), name, None)
            if isinstance(candidate, type) and (
                dataclasses.is_dataclass(candidate) or issubclass(candidate, enum.Enum)
            ):
                value = candidate
        elif module == "torch" and (
            name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)
        ):
            value = getattr(torch, name)
        elif module == "torch.serialization" and name == "_get_layout":
            value = torch.serialization._get_layout
        elif module == "pathlib" and name in (
            "Path",
            "PosixPath",
            "WindowsPath",
            "PurePosixPath",
            "PureWindowsPath",
        ):
            import pathlib

            value = getattr(pathlib, name)
        elif module == "collections" and name == "OrderedDict":
            import collections

            value = collections.OrderedDict
        if value is None:
            raise MeshfitError(
                f"refusing to load checkpoint metadata that references {module}.{name}: "
                f"it is not a meshfit/DCP checkpoint, or it was tampered with"
            )
        return value


TESTED_TORCH = "2.11 to 2.13"  # the versions this reader's private DCP uses ran on


def _requires(ok: bool, what: str) -> None:
    """Refuse clearly where this torch lacks a private DCP piece the safe reader uses."""
    if not ok:
        raise MeshfitError(
            f"meshfit's safe checkpoint reader uses DCP's {what}, which torch "
            f"{torch.__version__} does not have (tested with torch {TESTED_TORCH}); "
            f"install a tested torch version to load checkpoints"
        )


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader, with metadata read by an allow-listed unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        _requires(hasattr(getattr(self, "fs", None), "create_stream"), "FileSystemReader.fs")
        rank = kwargs.get("rank")
        if hasattr(self, "_get_metadata_path"):
            path = self._get_metadata_path(rank)
        else:  # older torch
            path = self.fs.concat_path(self.path, ".metadata")
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, reading non-tensor values with weights_only=True."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            # Same private helper DefaultLoadPlanner.load_bytes uses.
            try:
                from torch.distributed.checkpoint._traverse import set_element
            except ImportError:
                _requires(False, "_traverse.set_element")

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
