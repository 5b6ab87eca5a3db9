"""Demo data made on this machine (no downloads), the sampler fit uses, and documents
packed into rows (`mf.data.pack`)."""

from meshfit.data.packing import pack, stack
from meshfit.data.sampling import GlobalBatchSampler
from meshfit.data.text import ByteTextDataset, python_stdlib_text

__all__ = ["ByteTextDataset", "GlobalBatchSampler", "pack", "python_stdlib_text", "stack"]
