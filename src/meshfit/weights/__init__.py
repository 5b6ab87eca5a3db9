"""A model's values: built on meta and materialized shard by shard, pretrained weights
read slice by slice, the same start on every rank. `ModelValues` (values.py) is the one
entry point: compose.py makes one per engine and its forms call it at their moments."""

from meshfit.weights.values import ModelValues

__all__ = ["ModelValues"]
