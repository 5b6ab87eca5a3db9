"""Demo data made on this machine (no downloads) and the sampler fit uses."""

from meshfit.data.sampling import GlobalBatchSampler
from meshfit.data.text import ByteTextDataset, python_stdlib_text

__all__ = ["ByteTextDataset", "GlobalBatchSampler", "python_stdlib_text"]
