"""The decoder body without Hugging Face's per-layer Python (model_body.py): the layers'
norms, attention and feed-forward blocks, one module each."""

from paged_serve.engine.model.body.model_body import ModelBody
from paged_serve.engine.model.body.norms import RMSNorm

__all__ = ["ModelBody", "RMSNorm"]
