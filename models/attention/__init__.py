"""Attention variants behind one interface.

    y = attn(x, *, positions, segment_ids, cache=None, deterministic=True)

`base.MultiHeadAttention` owns projections, QK-norm, head split/merge and the output
projection; a variant subclasses it and overrides `attend`, which decides which keys
each query sees and how the scores are shaped. Importing this package registers every
variant; look one up with `get(name)`.
"""

from models.attention import adaptive_span  # noqa: F401  (adaptive_span, dynamic_span)
from models.attention import dense  # noqa: F401  (registers 'dense')
from models.attention import lsh  # noqa: F401  (registers 'lsh')
from models.attention import selective  # noqa: F401  (registers 'selective')
from models.attention import sparse  # noqa: F401  (strided, fixed, local, block_local, local_global)
from models.attention import transformer_xl  # noqa: F401  (registers 'txl')
from models.attention.base import IMPLEMENTATIONS, MultiHeadAttention, causal_segment_mask
from models.attention import traits  # What a variant declares besides its math: traits.of(name).
from models.attention.registry import (default_options, get, known, options, register,
                                       resolve_options)

__all__ = ['IMPLEMENTATIONS', 'MultiHeadAttention', 'causal_segment_mask', 'default_options',
           'get', 'known', 'options', 'register', 'resolve_options', 'traits']
