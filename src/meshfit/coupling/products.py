"""In-batch products: the similarity matrix of a contrastive loss, over the global batch.

CLIP, SigLIP and sentence-embedding models trained with in-batch negatives score every
sample against every other with one matrix product, `a @ b.T` of two (samples, width)
embeddings (transformers' CLIPModel: `torch.matmul(text_embeds, image_embeds.t())`;
sentence-transformers: `torch.mm(a, b.transpose(0, 1))`). On a rank holding a share of
the batch that product covers only the share: each rank contrasts its samples with each
other (measured: a tiny CLIP's first loss 3.6228 in one process, 2.9372 under dp=2).

While the loss of a step whose coupling probe found such a product runs, this mode
gathers both operands' sample rows from every rank of the batch (`scope.gather_rows`):
the product then covers the global batch on every rank, as open_clip's
gather-with-gradient does, found rather than written into the model. A product is one
whose first operand's rows and second operand's columns are the running micro-batch's
samples (a whole multiple of them, for several rows per sample), neither operand being
a parameter: a weight never holds the batch's rows.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from meshfit.coupling.scope import Scope, gather_rows

WHAT = "in-batch products"

_PRODUCTS = {
    torch.matmul,
    torch.mm,
    torch.Tensor.matmul,
    torch.Tensor.mm,
    torch.Tensor.__matmul__,
}


class InBatchProducts(TorchFunctionMode):
    """Gathers the operands of in-batch products over the scope's ranks."""

    def __init__(self, scope: Scope) -> None:
        super().__init__()
        self.scope = scope

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        if func in _PRODUCTS and not kwargs and len(args) == 2 and self._in_batch(*args):
            a, b = args
            return func(gather_rows(a, 0, WHAT), gather_rows(b, 1, WHAT))
        return func(*args, **kwargs)

    def _in_batch(self, a: Any, b: Any) -> bool:
        rows = self.scope.rows
        if not rows or not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.ndim != 2 or b.ndim != 2 or _is_weight(a) or _is_weight(b):
            return False
        return a.shape[0] % rows == 0 and b.shape[1] % rows == 0 and a.shape[0] > 0


def _is_weight(t: torch.Tensor) -> bool:
    """A parameter, or a view of one (a transposed weight)."""
    return isinstance(t, nn.Parameter) or isinstance(getattr(t, "_base", None), nn.Parameter)
