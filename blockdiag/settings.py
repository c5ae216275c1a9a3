"""User-tunable settings of the chooser and their precedence.

Precedence, highest first (each setting resolved on its own):

1. an enclosing ``with blockdiag.config(...)`` block (innermost wins);
2. :func:`blockdiag.set_sparsity_threshold` / :func:`set_config` (process-wide);
3. the environment variable (``BLOCKDIAG_SPARSITY_THRESHOLD``, ``BLOCKDIAG_DENSE_MAX_GROUPS``,
   ``BLOCKDIAG_DENSE_MAX_ELEMENTS``), read at each resolution;
4. the matching tuning profile's measured value (``blockdiag tune``);
5. the built-in default below.

A bad environment value raises :class:`BlockDiagError` naming the variable.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from ._errors import BlockDiagError

__all__ = ["Settings", "config", "set_config", "set_sparsity_threshold", "get_settings"]


@dataclass(frozen=True)
class Settings:
    """The knobs ``auto`` reads (all crossovers of the decision table).

    Attributes:
        sparsity_threshold: sparse layouts (CSR, BSR, torch-sparse) are candidates only when
            the weight's sparsity ``1 - 1/groups`` is at least this. ``1.0`` means never.
        dense_max_groups: the dense block-diagonal GEMM is a candidate only up to this many
            groups (its cost grows with ``groups**2``).
        dense_max_elements: ... and only while the dense matrix has at most this many entries.
        profile: path of the tuning profile, or None for the default location.
    """

    sparsity_threshold: float = 1.0
    dense_max_groups: int = 16
    dense_max_elements: int = 1 << 22
    profile: Optional[str] = None


DEFAULTS = Settings()
_ENV = {
    "sparsity_threshold": ("BLOCKDIAG_SPARSITY_THRESHOLD", float),
    "dense_max_groups": ("BLOCKDIAG_DENSE_MAX_GROUPS", int),
    "dense_max_elements": ("BLOCKDIAG_DENSE_MAX_ELEMENTS", int),
    "profile": ("BLOCKDIAG_PROFILE", str),
}
_FIELDS = tuple(_ENV)


class _Local(threading.local):
    # Class-level default: reading ``key`` in a thread that never entered ``config`` is a
    # plain lookup (``getattr(local, name, default)`` raises and catches, ~0.4 us).
    key: tuple = ()


_global: dict[str, Any] = {}
_local = _Local()
# Hashable snapshots of ``_global`` and of this thread's config stack, rebuilt when they
# change (rarely) so that :func:`token`, read on every ``auto`` call, only looks them up.
_global_key: tuple = ()


_KIND = {float: "a float", int: "an int", str: "a path (str or os.PathLike)"}


def _exact(typ: type, value: Any) -> bool:
    """Whether a non-string ``value`` is a ``typ`` without losing anything in the conversion."""
    if isinstance(value, bool):
        return False
    if typ is float:
        return isinstance(value, (int, float))
    if typ is int:
        return isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    return isinstance(value, os.PathLike)


def _validate(name: str, value: Any, source: str) -> Any:
    if name not in _ENV:
        raise BlockDiagError(f"config: unknown setting {name!r}; valid settings are {', '.join(_FIELDS)}")
    if value is None and name == "profile":
        return None
    typ = _ENV[name][1]
    if not isinstance(value, str) and not _exact(typ, value):
        # Strings are parsed (the environment's are), other values must already be what
        # they mean: True is not a threshold, 2.7 is not a group count, 5 is not a path.
        raise BlockDiagError(f"{source}: {name} must be {_KIND[typ]}, got {value!r}")
    if name == "profile" and isinstance(value, os.PathLike):
        value = os.fspath(value)
    try:
        v = typ(value)
    except (TypeError, ValueError):
        raise BlockDiagError(f"{source}: {name} must be {_KIND[typ]}, got {value!r}") from None
    if name == "sparsity_threshold" and not 0.0 <= v <= 1.0:
        raise BlockDiagError(f"{source}: sparsity_threshold must lie in [0, 1], got {v!r}")
    if name in ("dense_max_groups", "dense_max_elements") and v < 0:
        raise BlockDiagError(f"{source}: {name} must be >= 0, got {v!r}")
    return v


def set_config(**settings: Any) -> None:
    """Set chooser settings process-wide (``None`` un-sets one).

    >>> import blockdiag
    >>> blockdiag.set_config(dense_max_groups=8)
    >>> blockdiag.set_config(dense_max_groups=None)

    Args:
        **settings: any of the :class:`Settings` fields.

    Raises:
        BlockDiagError: unknown setting or out-of-range value.
    """
    global _global_key
    try:
        for k, v in settings.items():
            if v is None:
                _validate(k, 0 if k != "profile" else None, "set_config")
                _global.pop(k, None)
            else:
                _global[k] = _validate(k, v, "set_config")
    finally:
        # Also after a bad value: the settings applied before it stay applied.
        _global_key = tuple(sorted(_global.items()))


def set_sparsity_threshold(value: float | None) -> None:
    """Set the sparsity threshold process-wide; ``None`` returns to env/profile/default.

    >>> import blockdiag
    >>> blockdiag.set_sparsity_threshold(0.9)   # sparse layouts from 10 groups on
    >>> blockdiag.set_sparsity_threshold(None)

    It overrides ``$BLOCKDIAG_SPARSITY_THRESHOLD``, the tuning profile and the built-in
    default; an enclosing ``with blockdiag.config(sparsity_threshold=...)`` overrides it.
    ``1.0`` means sparse layouts are never candidates, ``0.0`` always.

    Args:
        value: in ``[0, 1]``; sparse layouts are candidates when ``1 - 1/groups >= value``.

    Raises:
        BlockDiagError: value outside ``[0, 1]``.
    """
    set_config(sparsity_threshold=value)


@contextlib.contextmanager
def config(**settings: Any) -> Iterator[None]:
    """Override chooser settings inside a ``with`` block (thread-local, nestable).

    The highest precedence: above :func:`set_config` / :func:`set_sparsity_threshold`,
    the environment variables, the tuning profile and the built-in defaults.

    >>> import blockdiag
    >>> with blockdiag.config(sparsity_threshold=0.0):
    ...     blockdiag.get_settings().sparsity_threshold
    0.0

    Args:
        **settings: any of the :class:`Settings` fields.

    Raises:
        BlockDiagError: unknown setting or out-of-range value.
    """
    frame = {k: _validate(k, v, "config") for k, v in settings.items()}
    stack = _local.__dict__.setdefault("stack", [])
    stack.append(frame)
    _local.key = _stack_key(stack)
    try:
        yield
    finally:
        stack.pop()
        _local.key = _stack_key(stack)


def _stack_key(stack: list) -> tuple:
    return tuple(tuple(sorted(f.items())) for f in stack)


def _explicit(name: str) -> tuple[Any, str] | None:
    for frame in reversed(getattr(_local, "stack", [])):
        if name in frame:
            return frame[name], "blockdiag.config()"
    if name in _global:
        return _global[name], "set_config()"
    env, _ = _ENV[name]
    raw = os.environ.get(env)
    if raw not in (None, ""):
        return _validate(name, raw, f"environment variable {env}"), f"${env}"
    return None


def resolve(name: str, profile_value: Any = None, profile_label: str = "tuning profile") -> tuple[Any, str]:
    """``(value, where it came from)`` for one setting, following the precedence above."""
    hit = _explicit(name)
    if hit is not None:
        return hit
    if profile_value is not None:
        return profile_value, profile_label
    return getattr(DEFAULTS, name), "built-in default"


# Every variable the chooser's answer depends on (the profile path's included).
_TOKEN_VARS = tuple(v for v, _ in _ENV.values()) + ("XDG_CACHE_HOME",)
# ``auto`` reads these on every forward call. ``os.environ.get`` encodes the key and
# raises/catches KeyError per miss (about 1 us each); reading the encoded mapping directly
# is ~20x cheaper and still sees every change made through ``os.environ``.
_ENV_DATA = getattr(os.environ, "_data", None)
_ENCODE = getattr(os.environ, "encodekey", None)
_TOKEN_KEYS = tuple(_ENCODE(v) for v in _TOKEN_VARS) if _ENV_DATA is not None and _ENCODE else None


if _TOKEN_KEYS is not None:
    # Unpacked by hand: five ``dict.get`` calls cost 130 ns, ``tuple(map(...))`` over the same
    # keys 310 ns, and this runs on every ``auto`` call. The unpacking fails at import if a
    # variable is added to ``_ENV`` without a slot here. Flat, not nested: the token is hashed
    # on every call too; ``token()[2:]`` are the variables' values.
    _K0, _K1, _K2, _K3, _K4 = _TOKEN_KEYS

    def token(_get=_ENV_DATA.get) -> tuple:
        """A cheap value that changes whenever any explicit setting (config, set_*, env) does."""
        return _local.key, _global_key, _get(_K0), _get(_K1), _get(_K2), _get(_K3), _get(_K4)

else:

    def token() -> tuple:
        """A cheap value that changes whenever any explicit setting (config, set_*, env) does."""
        return (_local.key, _global_key, *map(os.environ.get, _TOKEN_VARS))


def get_settings() -> Settings:
    """The settings in force here, without the profile's values (see ``explain`` for those).

    >>> import blockdiag
    >>> blockdiag.get_settings().dense_max_groups >= 0
    True

    Returns:
        a :class:`Settings` with each field's value from the first source that sets it.
    """
    return Settings(**{k: resolve(k)[0] for k in _FIELDS})
