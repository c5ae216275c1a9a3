"""The one error type that ``blockdiag`` raises for user mistakes."""

__all__ = ["BlockDiagError"]


class BlockDiagError(ValueError):
    """A user error: bad shapes, dtypes, devices, names or files.

    Subclasses :class:`ValueError` so that generic ``except ValueError`` code keeps working.
    Every message names the function or argument at fault and the actual values seen.

    >>> import blockdiag
    >>> try:
    ...     blockdiag.GroupedLinear(10, 6, groups=4)
    ... except blockdiag.BlockDiagError as e:
    ...     print(e)
    GroupedLinear: groups=4 must divide in_features=10 and out_features=6
    """
