"""Context-parallel attention: the ParallelStyles (``style``) and the ops they run.

``style_options`` holds each style's options (its ``[parallelism]`` keys, their one check and
what they derive), ``registry`` the styles by ``cp_style`` name and ``make_style``, which turns a
name and option values into the checked style.

``layouts`` says which tokens a rank holds, ``head_schedule`` which heads each UPipe stage moves;
``all_to_all`` is the sequence <-> head exchange, ``head_stages`` a stage's heads through it,
``ring`` the ring attention; ``staged_attention`` (UPipe, Ulysses, ring, 2D: the stage loop and
the projections) and ``fpdt_attention`` (chunked) are the ops, registered as one custom op each
by ``attention_op``.
"""

from upipe_dtensor.parallel.style import (
    ContextParallelAttention,
    FPDTAttention,
    RingAttention,
    UlyssesAttention,
    UPipeAttention,
    UPipeFPDTAttention,
)

__all__ = [
    "ContextParallelAttention",
    "UPipeAttention",
    "UPipeFPDTAttention",
    "UlyssesAttention",
    "RingAttention",
    "FPDTAttention",
]
