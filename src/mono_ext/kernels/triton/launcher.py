"""A Triton kernel's launch planned once per bound layer and run many times.

Triton's ``kernel[grid](*args, **constexprs)`` binds every argument, specialises it and hashes
the result into its cache key on every call: with K1/K2's ~35 arguments and ~60 constexprs
that is most of a launch's host time, and every K1/K2 launch of a layer passes the same
weights, workspaces, strides and constexprs step after step. A :class:`FrozenLaunch` takes
the variant Triton's own JIT picks for one real set of arguments (``warmup``: the same binder,
cache and compile as a launch), keeps the whole argument table, and afterwards replaces only
the positions a step changes (activations and the row count), calling the compiled kernel's
launcher directly.

That is only sound while those positions specialise as they did when the variant was picked:
pointers must keep 16-byte alignment, tensors their dtype and trailing shape, integers must be
unspecialised (``runtime.build_cache.check_unspecialized``). :meth:`FrozenLaunch.fits` checks
exactly that, plus contiguity and the row count, before each run; the caller re-plans (with its
full checks) when it fails. Under ``TRITON_INTERPRET=1`` nothing is compiled, and each run
goes through the JIT (one call per ``passes`` entry: the interpreter runs stages apart).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["ROWS", "FrozenLaunch", "FrozenLaunches", "Live", "live_template", "live_values"]


@dataclass(frozen=True)
class Live:
    """Placeholder for an argument a step changes, by its name in ``FrozenLaunch.names``."""

    name: str


ROWS = "n_rows"  # the live row count, a value of every frozen launch
_NONE = ("none",)  # FrozenLaunch.specs: this live value was None when planned


def _is_tensor(x: Any) -> bool:
    return hasattr(x, "data_ptr") and hasattr(x, "is_contiguous")


class FrozenLaunch:
    """One kernel's launch with every argument fixed except the :class:`Live` ones.

    ``template``: the kernel's positional arguments, :class:`Live` markers where a step's
    values go (a marker may appear at several positions); ``values``: the first step's values,
    in ``names`` order (one of them :data:`ROWS`, the row count); ``passes``: the constexpr sets to launch with, in order (more than one
    only under the interpreter); ``compiled``: take the compiled variant and launch it directly
    (False: every run goes through the JIT, as the interpreter needs).
    """

    def __init__(
        self,
        fn: Any,
        grid: int,
        template: Sequence[Any],
        names: Sequence[str],
        values: Sequence[Any],
        passes: Sequence[Mapping[str, Any]],
        *,
        compiled: bool,
        max_rows: int,
    ) -> None:
        self.fn = fn
        self.grid = (int(grid), 1, 1)
        self.names = tuple(names)
        self.max_rows = int(max_rows)
        self._rows_at = self.names.index(ROWS)
        index = {n: i for i, n in enumerate(self.names)}
        self.slots: tuple[tuple[int, int], ...] = tuple(
            (pos, index[a.name]) for pos, a in enumerate(template) if isinstance(a, Live)
        )
        if len(values) != len(self.names):
            raise ValueError(f"{len(values)} values for live arguments {self.names}")
        self.passes = [dict(p) for p in passes]
        if compiled and len(self.passes) != 1:
            raise ValueError("a compiled launch runs one pass")
        # what fits() holds each live value to: a tensor's (trailing shape, dtype); None stays
        # None (it chose the variant); the row count is checked on its own
        self.specs = tuple(
            (tuple(v.shape[1:]), v.dtype) if _is_tensor(v) else (_NONE if v is None else None)
            for v in values
        )
        table = self._fill(list(template), values)
        self._kernel = None
        if compiled:
            cx = self.passes[0]
            kernel = fn.warmup(*table, grid=self.grid, **cx)
            kernel = kernel.result() if hasattr(kernel, "result") else kernel
            self._kernel = kernel
            self._run = kernel.run  # loads the module (its handles) once, here
            self._function = kernel.function
            self._metadata = kernel.packed_metadata
            self._device = _current_device()
            table += _constexpr_tail(fn, len(table), cx)
            _check_binding(fn, self._device, table, len(template), cx)
        self.table = table

    def _fill(self, table: list, values: Sequence[Any]) -> list:
        for pos, k in self.slots:
            table[pos] = values[k]
        return table

    def fits(self, values: Sequence[Any]) -> bool:
        """``values`` specialise as the planned ones did, are contiguous, and have the live
        row count (1..max_rows) of leading rows."""
        rows = values[self._rows_at]
        if not 1 <= rows <= self.max_rows:
            return False
        for v, spec in zip(values, self.specs, strict=True):
            if spec is None:
                continue
            if spec is _NONE:
                if v is not None:
                    return False
                continue
            if (
                not _is_tensor(v)
                or v.dtype != spec[1]
                or v.shape[0] != rows
                or tuple(v.shape[1:]) != spec[0]
                or v.data_ptr() % 16
                or not v.is_contiguous()
            ):
                return False
        return True

    def run(self, values: Sequence[Any]) -> None:
        """Launch with ``values`` (``names`` order) in the live positions; the caller has
        checked :meth:`fits`."""
        table = self._fill(self.table.copy(), values)
        if self._kernel is None:
            for cx in self.passes:
                self.fn[self.grid](*table, **cx)
            return
        from triton import knobs

        stream = _current_stream(self._device)
        enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        meta = self._kernel.launch_metadata(self.grid, stream, *table)  # as the JIT asks it
        self._run(*self.grid, stream, self._function, self._metadata, meta, enter, leave, *table)


def _current_stream(device: int) -> int:
    """The stream Triton's JIT would launch on (torch's current stream of ``device``)."""
    from triton.runtime.driver import driver

    return driver.active.get_current_stream(device)


def _current_device() -> int:
    """The device Triton's JIT launches on and keys its caches by."""
    from triton.runtime.driver import driver

    return driver.active.get_current_device()


def _check_binding(fn: Any, device: int, table: list, given: int, cx: Mapping[str, Any]) -> None:
    """Refuse a table that differs from what Triton's own binder makes of the same arguments
    (its JIT launches with exactly that), where the binder can be reached."""
    caches = getattr(fn, "device_caches", None)
    entry = caches.get(device) if isinstance(caches, dict) else None
    if entry is None:
        return
    bound = list(entry[-1](*table[:given], **cx)[0].values())
    if len(bound) != len(table) or any(a is not b for a, b in zip(bound, table, strict=True)):
        raise RuntimeError(
            f"{getattr(fn, '__name__', fn)}: the frozen argument table differs from Triton's "
            "binding of the same arguments; this Triton's launch convention is not the one "
            "kernels.triton.launcher was written for"
        )


def _constexpr_tail(fn: Any, given: int, cx: Mapping[str, Any]) -> list:
    """The kernel's parameters after the ``given`` positional ones, as Triton's binder hands
    them to the launcher (every parameter, constexprs included, in signature order)."""
    tail = []
    for p in fn.params[given:]:
        if p.name in cx:
            tail.append(cx[p.name])
        elif p.has_default:
            tail.append(p.default)
        else:
            raise ValueError(f"{fn}: no value for parameter {p.name!r}")
    return tail


@dataclass
class _Entry:
    owner: Any
    launch: FrozenLaunch


class FrozenLaunches:
    """The frozen launches of a deployment, one per (layer, variant) key, each kept while the
    object it was planned for (the bound layer) is the one launched with."""

    def __init__(self) -> None:
        self._entries: dict[Any, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def get(
        self,
        key: Any,
        owner: Any,
        values: Sequence[Any],
        plan: Callable[[], FrozenLaunch],
    ) -> FrozenLaunch:
        """The launch for ``key``; ``plan()`` (which runs the full checks) makes a new one when
        there is none, ``owner`` changed, or ``values`` do not fit the planned one."""
        e = self._entries.get(key)
        if e is not None and e.owner is owner and e.launch.fits(values):
            return e.launch
        launch = plan()
        self._entries[key] = _Entry(owner, launch)
        return launch


def live_template(tensors: Sequence[Any], live_at: Sequence[int]) -> tuple[list, tuple, list]:
    """``tensors`` with the positions ``live_at`` replaced by :class:`Live` markers (a None
    stays None: it selects a variant, it is not a value), the markers' names with the row
    count's last, and the first step's values in that order (rows last)."""
    template = list(tensors)
    names, values = [], []
    for i in live_at:
        name = f"arg{i}"
        names.append(name)
        values.append(tensors[i])
        if tensors[i] is not None:
            template[i] = Live(name)
    rows = tensors[live_at[0]].shape[0]
    return template, (*names, ROWS), [*values, rows]


def live_values(tensors: Sequence[Any], live_at: Sequence[int]) -> list:
    """A later step's values for a launch planned by :func:`live_template` (rows last)."""
    values = [tensors[i] for i in live_at]
    values.append(tensors[live_at[0]].shape[0])
    return values
