"""Every backend as a registered torch operator (``torch.ops.blockdiag.<name>``).

A backend module declares its kernels as an :class:`OpEntry` and :func:`define` registers
them: ``blockdiag::<name>`` (forward) and ``blockdiag::<name>_backward`` (first-order
gradients), each with a fake kernel, autograd (with forward AD), a vmap rule and FLOP formulas.
``blockdiag::auto`` (:mod:`blockdiag.ops.auto`) plans per call inside traced graphs. See
``_define`` for the three routes a call can take.
"""

from ._define import OpEntry, backward_op, define, entries, forward_op, generic_backward, plain_eager

__all__ = ["OpEntry", "backward_op", "define", "entries", "forward_op", "generic_backward", "plain_eager"]
