"""Dense causal softmax attention (Vaswani et al., 2017): the zoo's baseline."""

from models.attention import base, patterns, traits
from models.attention.registry import register


@register('dense')
class DenseAttention(base.MultiHeadAttention):
  """Every query attends to all earlier keys of its own document.

  softmax(Q K^T / sqrt(d_head) + M) V with M the causal, same-document mask: the pattern
  patterns.Dense in every head, computed by whichever kernel models/attention/dispatch.py
  picks (cuDNN's flash kernel on GPU, splash on TPU, the C++ tile kernel on one CPU).
  """

  def head_pattern(self, head):
    return patterns.Dense()


@traits.declare('dense')
class DenseTraits(traits.Traits):
  DENSE = True  # Every head of every layer: cuDNN's flash kernel can compute it.
