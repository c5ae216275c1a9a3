"""User-tunable settings of the chooser and their precedence.

Precedence, highest first (each setting resolved on its own):

1. an enclosing ``with blockdiag.config(...)`` block (innermost wins);
2. :func:`blockdiag.set_sparsity_threshold` / :func:`set_config` (process-wide);
3. the environment variable (``BLOCKDIAG_SPARSITY_THRESHOLD``, ``BLOCKDIAG_DENSE_MAX_GROUPS``,
   ``BLOCKDIAG_DENSE_MAX_ELEMENTS``, ``BLOCKDIAG_DOUBLE_BACKWARD``, ``BLOCKDIAG_PROFILE``),
   read at each resolution;
4. the matching tuning profile's measured value (``blockdiag tune``);
5. the built-in default below.

A bad environment value raises :class:`BlockDiagError` naming the variable.

This module also keeps the chooser's epoch (:func:`epoch`, :func:`bump_epoch`): one value
that changes whenever anything ``auto``'s answer depends on may have changed. It lives here,
the package's leaf, so that every mutator (settings, profiles, the backend registry) can
reach it without an import cycle; :mod:`blockdiag.dispatch` explains the design.
"""

from __future__ import annotations

import contextlib
import itertools
import numbers
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

from ._checks import as_size
from ._errors import BlockDiagError

__all__ = ["Settings", "config", "set_config", "set_sparsity_threshold", "get_settings", "epoch", "bump_epoch"]


@dataclass(frozen=True)
class Settings:
    """The knobs ``auto`` reads: the decision table's crossovers, its path, and ``double_backward``.

    Attributes:
        sparsity_threshold: sparse layouts (CSR, BSR, torch-sparse) are candidates only when
            the weight's sparsity ``1 - 1/groups`` is at least this. ``1.0`` means never.
        dense_max_groups: the dense block-diagonal GEMM is a candidate only up to this many
            groups (its cost grows with ``groups**2``). Neither crossover applies to one
            group, where the dense matrix is the weight itself (see
            :data:`blockdiag.dispatch.ONE_GROUP_RULE`).
        dense_max_elements: ... and only while the dense matrix has at most this many entries.
        profile: path of the tuning profile, or None for the default location.
        double_backward: ``True`` keeps ``auto``, for training, on the backends whose backward
            is itself differentiable (:attr:`blockdiag.Backend.double_grad`), so that
            ``create_graph=True`` (gradient penalties, Hessian-vector products) works
            whichever backend the table ranks first. Off by default, so ``auto`` may train
            on a first-order backend (the sparse layouts, ``grouped_mm``), and such a backend
            refuses a second backward with :class:`BlockDiagError`. The environment variable takes
            ``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off``.
    """

    sparsity_threshold: float = 1.0
    dense_max_groups: int = 16
    dense_max_elements: int = 1 << 22
    profile: Optional[str] = None
    double_backward: bool = False


DEFAULTS = Settings()
_ENV = {
    "sparsity_threshold": ("BLOCKDIAG_SPARSITY_THRESHOLD", float),
    "dense_max_groups": ("BLOCKDIAG_DENSE_MAX_GROUPS", int),
    "dense_max_elements": ("BLOCKDIAG_DENSE_MAX_ELEMENTS", int),
    "profile": ("BLOCKDIAG_PROFILE", str),
    "double_backward": ("BLOCKDIAG_DOUBLE_BACKWARD", bool),
}
_FIELDS = tuple(_ENV)


class _Local(threading.local):
    # ``key`` names this thread's stack of ``config`` frames (0: none), see ``_stack_id``.
    # Set in each thread's own dict on its first access (threading.local runs __init__ per
    # thread): a plain lookup (``getattr(local, name, default)`` raises and catches, ~0.4 us),
    # and dynamo, which guards a compiled graph on it, sees the same attribute in and out
    # of ``config`` blocks (a class-level default shadowed later escaped its guard).
    def __init__(self) -> None:
        self.key = 0
        # The torch thread count this thread's epoch last saw (-1: none yet). Per thread:
        # under OpenMP ``torch.set_num_threads`` sets the calling thread's count (and that of
        # threads that make their first torch call later), so threads can differ for good.
        self.threads = -1


_global: dict[str, Any] = {}
_local = _Local()


_KIND = {float: "a float", int: "an int", str: "a path (str or os.PathLike)", bool: "True or False"}
# What the environment may say for a bool setting (case-insensitive).
_BOOL_WORDS = {
    "1": True, "true": True, "yes": True, "on": True,
    "0": False, "false": False, "no": False, "off": False,
}


def _numpy_bool(value: Any) -> bool:
    """Whether ``value`` is NumPy's bool scalar (no ``bool`` subclass; NumPy is not imported)."""
    return type(value).__module__ == "numpy" and type(value).__name__ in ("bool_", "bool")


def _exact(typ: type, value: Any) -> bool:
    """Whether a non-string ``value`` is a ``typ`` without losing anything in the conversion.

    NumPy's scalars count as the Python numbers they hold, as sizes do elsewhere
    (:func:`blockdiag._checks.as_size`): ``np.int64(8)`` is a group count, ``np.float32(0.9)``
    a threshold (``np.float64`` subclasses ``float``, ``np.float32`` does not).
    """
    if typ is bool:
        return isinstance(value, bool) or _numpy_bool(value)
    if isinstance(value, bool):
        return False
    if typ is float:
        return isinstance(value, numbers.Real)
    if typ is int:
        v = as_size(value)
        if isinstance(v, int) and not isinstance(v, bool):
            return True
        # A whole float counts as its int, of any float type: np.float32 is no float subclass,
        # so 8.0 and np.float64(8.0) were taken and np.float32(8.0) refused.
        if not isinstance(value, numbers.Real):
            return False
        try:
            return float(value).is_integer()  # False for inf and nan
        except OverflowError:  # Fraction(10**400)
            return False
    return isinstance(value, os.PathLike)


def _validate(name: str, value: Any, source: str) -> Any:
    if name not in _ENV:
        raise BlockDiagError(f"{source}: unknown setting {name!r}; valid settings are {', '.join(_FIELDS)}")
    if value is None and name == "profile":
        return None
    typ = _ENV[name][1]
    if not isinstance(value, str) and not _exact(typ, value):
        # Strings are parsed (the environment's are), other values must already be what
        # they mean: True is not a threshold, 2.7 is not a group count, 5 is not a path.
        raise BlockDiagError(f"{source}: {name} must be {_KIND[typ]}, got {value!r}")
    if name == "profile" and isinstance(value, os.PathLike):
        value = os.fspath(value)
    if typ is bool:
        # bool("false") is True: a string must be one of the words, not merely non-empty.
        if not isinstance(value, str):
            return bool(value)
        v = _BOOL_WORDS.get(value.strip().lower())
        if v is None:
            raise BlockDiagError(
                f"{source}: {name} must be {_KIND[typ]} (or 1/0, true/false, yes/no, on/off), got {value!r}"
            )
        return v
    try:
        v = typ(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: float(2**2000)
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
    _set_global("set_config", settings)


def _set_global(source: str, settings: dict) -> None:
    """:func:`set_config`'s work; ``source`` is the caller the error messages name."""
    # All checked before any is applied (as config() does): a bad value changes nothing.
    checked = {}
    for k, v in settings.items():
        if v is None:
            if k not in _ENV:  # an unknown name raises; a known one is un-set, no value to check
                _validate(k, None, source)
            checked[k] = None
        else:
            checked[k] = _validate(k, v, source)
    for k, v in checked.items():
        if v is None:
            _global.pop(k, None)
        else:
            _global[k] = v
    bump_epoch()


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
    _set_global("set_sparsity_threshold", {"sparsity_threshold": value})


@contextlib.contextmanager
def config(**settings: Any) -> Iterator[None]:
    """Override chooser settings inside a ``with`` block (thread-local, nestable).

    Thread-local like ``torch.no_grad``: an ``await`` inside the block lets the thread's
    other asyncio tasks run under these settings too; keep awaits out of it.

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
    if torch.compiler.is_compiling():
        # Dynamo would only simulate this block's thread-local frame, while the plans of the
        # layers inside it are made, and their plan state read, from the real settings when
        # the graph is traced: the compiled code would silently run the plan of the settings
        # outside the block. A graph break runs the block eagerly; the layers inside it are
        # compiled on their own, under these settings, and guarded on them.
        torch._dynamo.graph_break(
            msg="blockdiag.config(...) runs eagerly, not inside a compiled graph (the layers' plans are "
                "made from the settings in force when the graph is traced); under fullgraph=True, enter "
                "the block outside the compiled function, or set the settings with blockdiag.set_config")
    stack = _local.__dict__.setdefault("stack", [])
    stack.append(frame)
    _local.key = _stack_id(stack)
    try:
        yield
    finally:
        # This frame, not the top one: blocks left out of order (generators, tasks) each
        # take their own frame away.
        del stack[max(k for k, f in enumerate(stack) if f is frame)]
        _local.key = _stack_id(stack)


# A config stack's content, as a small int that :func:`epoch` hashes cheaply on every call.
# Equal stacks get the same id (in any thread), so re-entering the same ``config`` block,
# say once per training step, finds the plans cached the first time; an id is never reused
# for other content (ids only grow, also after the table is forgotten).
_stack_ids: dict[tuple, int] = {(): 0}
_next_stack_id = itertools.count(1).__next__


def _stack_id(stack: list) -> int:
    content = tuple(tuple(sorted(f.items(), key=lambda kv: kv[0])) for f in stack)
    sid = _stack_ids.get(content)
    if sid is None:
        if len(_stack_ids) > 4096:  # distinct settings without end: start again
            _stack_ids.clear()
            _stack_ids[()] = 0
        sid = _stack_ids.setdefault(content, _next_stack_id())
    return sid


def _explicit(name: str) -> tuple[Any, str] | None:
    for frame in reversed(getattr(_local, "stack", [])):
        if name in frame:
            return frame[name], "blockdiag.config()"
    if name in _global:
        return _global[name], "set_config()"
    env, _ = _ENV[name]
    raw = os.environ.get(env)
    if raw is not None and raw.strip():  # blank as unset
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


# The epoch (the design is explained in blockdiag.dispatch's docstring).
#
# ``generation`` is the one counter every in-process mutator moves (``bump_epoch``):
# ``set_config``, a profile written or forgotten (blockdiag.profile), a backend registered,
# replaced or removed (blockdiag.backends._registry), and the periodic look at the profile
# files and the thread count (``_recheck``) when it finds a change. It only grows, and each
# bump takes a fresh value from a C-level counter (atomic under the GIL), so no two states
# share one.
generation = 0
_next_generation = itertools.count(1).__next__
# When (``time.monotonic``) :func:`epoch` next looks at the profile files on disk; 0.0 after
# every bump, so the first call after a change looks at once.
_recheck_at = 0.0


def bump_epoch() -> None:
    """Start a new epoch: every plan cached before is stale. Called after each mutation."""
    global generation, _recheck_at
    generation = _next_generation()
    _recheck_at = 0.0


def _recheck(now: float, threads: int) -> None:
    """Note this thread's count ``threads`` and, when due, look at the profile files.

    The count is part of the epoch itself, so threads whose counts differ keep plans of
    their own, and switching between them moves nothing (a process-wide "count last seen"
    bumped the generation, dropping every plan and compiled graph, at each switch). A change
    of this thread's own count still bumps: graphs compiled with a plan inlined are guarded
    on the generation, not on the count. A file change bumps too.
    """
    global _recheck_at
    # blockdiag.profile imports this module, so it is imported here, not at the top.
    from . import profile

    seen, _local.threads = _local.threads, threads
    if seen != threads and seen != -1:
        bump_epoch()
    if now >= _recheck_at:
        profile.changed_on_disk()
        _recheck_at = now + profile.RECHECK_S  # after: a bump resets it to 0.0


# Every variable the chooser's answer depends on (the profile path's included).
_EPOCH_VARS = tuple(v for v, _ in _ENV.values()) + ("XDG_CACHE_HOME",)
# ``auto`` reads these on every forward call. ``os.environ.get`` encodes the key and
# raises/catches KeyError per miss (about 1 us each); reading the encoded mapping directly
# is ~20x cheaper and still sees every change made through ``os.environ``.
_ENV_DATA = getattr(os.environ, "_data", None)
_ENCODE = getattr(os.environ, "encodekey", None)
_EPOCH_KEYS = tuple(_ENCODE(v) for v in _EPOCH_VARS) if _ENV_DATA is not None and _ENCODE else None


if _EPOCH_KEYS is not None:
    # Unpacked by hand: one ``dict.get`` call per key, written out, costs about half of
    # ``tuple(map(...))`` over the same keys (no iterator, no tuple growth), and this runs on
    # every ``auto`` call. The unpacking fails at import if a variable is added to ``_ENV``
    # without a slot here. Flat, not nested: the epoch is hashed on every call too;
    # ``epoch()[2:-1]`` are the variables' values, the last item this thread's count.
    _K0, _K1, _K2, _K3, _K4, _K5 = _EPOCH_KEYS

    def epoch(_get=_ENV_DATA.get, _now=time.monotonic, _threads=torch.get_num_threads) -> tuple:
        """A cheap, hashable value that changes whenever ``auto``'s answer may change.

        ``(generation, this thread's config stack, the six environment variables, this
        thread's torch thread count)``; the profile files on disk are looked at every
        :data:`blockdiag.profile.RECHECK_S` seconds at most (a change bumps ``generation``,
        as does a change of this thread's own count: see :func:`_recheck`).
        See :mod:`blockdiag.dispatch`.
        """
        threads = _threads()
        if _now() >= _recheck_at or threads != _local.threads:
            _recheck(_now(), threads)
        return (generation, _local.key, _get(_K0), _get(_K1), _get(_K2), _get(_K3), _get(_K4), _get(_K5),
                threads)

else:

    def epoch(_now=time.monotonic, _threads=torch.get_num_threads) -> tuple:
        """A cheap, hashable value that changes whenever ``auto``'s answer may change."""
        threads = _threads()
        if _now() >= _recheck_at or threads != _local.threads:
            _recheck(_now(), threads)
        return (generation, _local.key, *map(os.environ.get, _EPOCH_VARS), threads)


# The name before the epoch: memos keyed on it (blockdiag.nn.mlp's) keep working.
token = epoch


def get_settings() -> Settings:
    """The settings in force here, without the profile's values (see ``explain`` for those).

    >>> import blockdiag
    >>> blockdiag.get_settings().dense_max_groups >= 0
    True

    Returns:
        a :class:`Settings` with each field's value from the first source that sets it.
    """
    return Settings(**{k: resolve(k)[0] for k in _FIELDS})
