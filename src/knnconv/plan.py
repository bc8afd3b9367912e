"""Plans: the sizes and index tables of one layer geometry, built once per layer and shared
by every call.

:class:`KNNConvPlan` (KNN convolution) holds the raw neighbour tables (knn_indices, rf_index)
and the compact int32 gather tables (input_linear, weight_linear); :class:`NeighbourhoodPlan`
(the per-channel layers: pooling and depthwise convolution) holds knn_indices and, for a
depthwise layer, each slot's kernel cell. Both copy their tables lazily to each device they are
used on (the compact tables only when a kernel that reads them runs there); tables a backend
derives (launch buffers, reverse maps) are built once per device through
:meth:`GeometryPlan.derived` and live as long as the plan. A plan's ``handle`` is the
string that names it inside the knnconv custom ops.
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ._checks import as_index_tensor, check_knn_indices, check_positive, check_tables
from .persistent import build_persistent, on_builder_thread

INT32_MAX = 2**31 - 1
# The live plans by handle (KNNConvPlan.handle), under the lock: a handle names a plan inside
# torch.library op calls. Plans with one handle have the same sizes and tables (copies of one
# plan, or one geometry built twice), so any of them serves a call. The lock is reentrant: a
# plan's finalizer (_forget_handle) may run in a thread that holds it, when garbage collection
# runs there.
_plans_lock = threading.RLock()
_plans_by_handle: dict[str, weakref.WeakSet] = {}
SLOT_ALIGN = 64  # P is padded to a multiple of this so every kernel K-tile is full.


def compact_tables(
    knn_indices: torch.Tensor, rf_index: torch.Tensor, cin: int, nin: int, v: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The persistent int32 gather tables of knnconv.cuda's API, each [Nout, P64].

    Slot p = c*K + k. ``input_linear[n, p] = c*Nin + knn[k, n]`` (``Cin*Nin`` for a padding
    neighbour and for every slot p >= Cin*K); ``weight_linear[n, p] = c*V + rf[n, k]``
    (0 on the slots p >= Cin*K). The tables live on the device of ``knn_indices``.
    """
    knn_indices = as_index_tensor("knn_indices", knn_indices)
    rf_index = as_index_tensor("rf_index", rf_index).to(knn_indices.device)
    cin, nin, v = (check_positive(n, val) for n, val in (("cin", cin), ("nin", nin), ("v", v)))
    check_tables(knn_indices, rf_index, nin, v)
    if cin * nin + 1 > INT32_MAX or cin * v > INT32_MAX:
        raise ValueError(f"cin*nin ({cin * nin}) and cin*v ({cin * v}) must fit in int32")
    k, nout = knn_indices.shape
    p = cin * k
    p64 = -(-p // SLOT_ALIGN) * SLOT_ALIGN
    knn = knn_indices.to(torch.int64).t()  # [Nout, K]
    channel = torch.arange(cin, device=knn.device).view(1, cin, 1)
    gathered = torch.where(knn.unsqueeze(1) == nin, cin * nin, knn.unsqueeze(1) + channel * nin)
    binned = rf_index.to(torch.int64).unsqueeze(1) + channel * v
    input_linear = torch.full((nout, p64), cin * nin, dtype=torch.int32, device=knn.device)
    weight_linear = torch.zeros((nout, p64), dtype=torch.int32, device=knn.device)
    input_linear[:, :p] = gathered.reshape(nout, p)
    weight_linear[:, :p] = binned.reshape(nout, p)
    return input_linear, weight_linear


@dataclass
class DeviceTables:
    """One plan's tables on one device, plus the tables backends derived there.

    The compact gather tables (input_linear, weight_linear: int32 [Nout, P64], the largest a
    plan has) serve only knnconv.cuda's API and the cuda backend's kernels that re-lay x out;
    the kernels of channels-last layers never read them. So a device gets its copy when
    first asked for it: ``compact`` holds the pair, or (on a device) what copies it there.
    """

    knn_indices: torch.Tensor  # int64 [K, Nout]
    rf_index: torch.Tensor  # int64 [Nout, K]
    compact: tuple[torch.Tensor, torch.Tensor] | Callable[[], tuple[torch.Tensor, torch.Tensor]]
    derived: dict[str, Any] = field(default_factory=dict)

    def compact_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_linear, weight_linear) on this device."""
        return self.compact if isinstance(self.compact, tuple) else self.compact()

    @property
    def input_linear(self) -> torch.Tensor:
        return self.compact_tables()[0]

    @property
    def weight_linear(self) -> torch.Tensor:
        return self.compact_tables()[1]


class _CompactCopy:
    """A plan's compact tables copied to one device on first call (a derived table of the
    plan there); it holds the plan weakly, so the plan's device tables do not keep it
    alive."""

    def __init__(self, plan: KNNConvPlan, device: torch.device) -> None:
        self._plan, self._device = weakref.ref(plan), device

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        plan = self._plan()
        if plan is None:
            raise RuntimeError("the plan of these tables is gone")
        host = plan._host.compact
        return plan.derived(self._device, "compact", lambda _: tuple(
            table.to(self._device) for table in host))


@dataclass
class NeighbourhoodTables:
    """One NeighbourhoodPlan's tables on one device, plus the tables backends derived there."""

    knn_indices: torch.Tensor  # int64 [K, Nout]
    slot_cells: torch.Tensor | None  # int64 [K, Nout]: each slot's kernel cell, V for padding
    derived: dict[str, Any] = field(default_factory=dict)


class GeometryPlan:
    """What every plan shares: host tables copied to each device on first use, tables derived
    from them once per device, and a content-named handle registered while the plan lives.

    Subclasses set ``self._host`` (a tables dataclass with a ``derived`` dict) and call
    :meth:`_finish`.
    """

    _host: Any

    def _finish(self) -> None:
        self._per_device: dict[torch.device, Any] = {torch.device("cpu"): self._host}
        self._start_building()
        self._register()

    def _copy_tables(self, device: torch.device):
        """The host tables copied to ``device``, with an empty ``derived``."""
        raise NotImplementedError

    def _describe(self) -> str:
        """The sizes part of the handle: ``Name(size=..., ...``, closed by the tables' digest."""
        raise NotImplementedError

    def _hashed_tables(self) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def _start_building(self) -> None:
        # Builds in progress: (cache id, key) -> (the building thread, the Future later callers
        # wait on). The lock guards this map and the caches' writes only; no lock is held while
        # a build runs, since a build runs on another thread (knnconv.persistent) and may itself
        # build host tables of this plan.
        self._building_lock = threading.Lock()
        self._building: dict[tuple[int, Any], tuple[int, Future]] = {}

    def _build_once(self, cache: dict, key: Any, device: torch.device, build: Callable[[], Any]):
        """cache[key], built by the first caller with ``build_persistent(device, build)``;
        callers arriving meanwhile wait for that build's result (or its error). The tables are
        ordered after the build on the building caller's stream (see knnconv.persistent)."""
        claim, me = (id(cache), key), threading.get_ident()
        with self._building_lock:
            value = cache.get(key)
            if value is not None:
                return value
            underway = self._building.get(claim)
            if underway is None:
                future = Future()
                self._building[claim] = (me, future)
        if underway is not None:
            builder, future = underway
            if builder == me:
                raise RuntimeError(f"building the plan's {key!r} tables needs them built")
            if not on_builder_thread():
                return future.result()
            # The table thread must not wait for a caller who may be waiting for it: it builds
            # too (inline, being that thread), and the first result stored is everyone's.
            value = build()
            with self._building_lock:
                return cache.setdefault(key, value)
        try:
            value = build_persistent(device, build)
        except BaseException as exc:
            # an interrupt is this thread's own: waiting threads get an error of their own
            error = exc if isinstance(exc, Exception) else RuntimeError(
                f"building the plan's {key!r} tables stopped")
            with self._building_lock:
                del self._building[claim]
            future.set_exception(error)
            raise
        with self._building_lock:
            value = cache.setdefault(key, value)
            del self._building[claim]
        future.set_result(value)
        return value

    def _register(self) -> None:
        # A string, never an int: torch.compile turns an int that differs between calls of one
        # piece of code into a symbolic size, which names no plan, while a string stays a
        # constant of the graph. Its content names the sizes and tables, so a graph that
        # torch.compile cached on disk in another process serves only plans it fits.
        digest = hashlib.blake2b(digest_size=16)
        for table in self._hashed_tables():
            digest.update(table.numpy())
        self.handle = f"{self._describe()}, tables={digest.hexdigest()})"
        with _plans_lock:
            plans = _plans_by_handle.setdefault(self.handle, weakref.WeakSet())
            plans.add(self)
            # stored again: the finalizer of a twin that died meanwhile may have dropped it
            _plans_by_handle[self.handle] = plans
        weakref.finalize(self, _forget_handle, self.handle)

    @staticmethod
    def from_handle(handle: str) -> GeometryPlan:
        with _plans_lock:
            plan = next(iter(_plans_by_handle.get(handle, ())), None)
        if plan is None:
            raise RuntimeError(f"knnconv plan handle {handle!r} names no live plan")
        return plan

    def __getstate__(self) -> dict:
        # Pickling and deep copies carry the host tables and what was derived from them on the
        # host; device copies (with their derived tables) are rebuilt on use.
        state = self.__dict__.copy()
        del state["_building_lock"], state["_building"]
        with self._building_lock:  # a snapshot: another thread may be adding a derived table
            host = replace(self._host, derived=dict(self._host.derived))
        state["_host"], state["_per_device"] = host, {torch.device("cpu"): host}
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._start_building()
        self._register()

    def on(self, device: torch.device | str):
        """The tables on ``device``, copied there on first use and cached for the plan's life."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        tables = self._per_device.get(device)
        if tables is None:
            tables = self._build_once(self._per_device, device, device,
                                      lambda: self._copy_tables(device))
        return tables

    def derived(self, device: torch.device | str, key: str, build: Callable[[Any], Any]) -> Any:
        """A table derived from this plan on ``device``, built once by ``build(tables)``."""
        tables = self.on(device)
        value = tables.derived.get(key)
        if value is None:
            value = self._build_once(tables.derived, key, tables.knn_indices.device,
                                     lambda: build(tables))
        return value


class KNNConvPlan(GeometryPlan):
    """Sizes and tables of one KNN-convolution geometry; build with :func:`make_plan`.

    Plans with the same sizes and tables have the same handle.
    """

    def __init__(
        self, knn_indices: torch.Tensor, rf_index: torch.Tensor, *, nin: int, v: int, cin: int,
        cout: int,
    ) -> None:
        knn_indices = as_index_tensor("knn_indices", knn_indices)
        rf_index = as_index_tensor("rf_index", rf_index)
        self.nin = check_positive("nin", nin)
        self.v = check_positive("v", v)
        self.cin = check_positive("cin", cin)
        self.cout = check_positive("cout", cout)
        input_linear, weight_linear = compact_tables(
            knn_indices.cpu(), rf_index.cpu(), self.cin, self.nin, self.v
        )
        self.k, self.nout = knn_indices.shape
        self.p = self.cin * self.k
        self.p64 = input_linear.shape[1]
        self.q = self.cin * self.v
        self.padding_fraction = float((knn_indices == self.nin).float().mean())
        self._host = DeviceTables(
            knn_indices.cpu().to(torch.int64).contiguous(),
            rf_index.cpu().to(torch.int64).contiguous(),
            (input_linear, weight_linear),
        )
        self._count_entries()
        self._finish()

    def _count_entries(self) -> None:
        # entry_count: the real (node, neighbour) pairs, what a kernel that skips padding
        # contracts over. Counted when the plan is built (or unpickled without it), not on
        # first use: torch.compile would trace the count's .item() and break the graph there.
        self.entry_count = int((self._host.knn_indices != self.nin).sum())

    def __setstate__(self, state: dict) -> None:
        host = vars(state["_host"])
        if "compact" not in host:  # pickled when the compact tables were two fields of their own
            host["compact"] = (host.pop("input_linear"), host.pop("weight_linear"))
        super().__setstate__(state)
        if "entry_count" not in state:  # pickled before plans counted their entries
            self._count_entries()

    def _copy_tables(self, device: torch.device) -> DeviceTables:
        host = self._host
        return DeviceTables(host.knn_indices.to(device), host.rf_index.to(device),
                            _CompactCopy(self, device))

    def _describe(self) -> str:
        return (f"KNNConvPlan(cin={self.cin}, cout={self.cout}, nin={self.nin}, "
                f"nout={self.nout}, k={self.k}, v={self.v}")

    def _hashed_tables(self) -> tuple[torch.Tensor, ...]:
        return self._host.knn_indices, self._host.rf_index

    @property
    def knn_indices(self) -> torch.Tensor:
        return self._host.knn_indices

    @property
    def rf_index(self) -> torch.Tensor:
        return self._host.rf_index

    def __repr__(self) -> str:
        return (
            f"KNNConvPlan(cin={self.cin}, cout={self.cout}, nin={self.nin}, nout={self.nout}, "
            f"k={self.k}, v={self.v}, p64={self.p64}, padding={self.padding_fraction:.1%})"
        )

def _forget_handle(handle: str) -> None:
    """Drop a handle whose last plan has died (a WeakSet yields only live plans)."""
    with _plans_lock:
        plans = _plans_by_handle.get(handle)
        if plans is not None and next(iter(plans), None) is None:
            del _plans_by_handle[handle]


def make_plan(
    knn_indices: torch.Tensor, rf_index: torch.Tensor, *, nin: int, v: int, cin: int, cout: int
) -> KNNConvPlan:
    """Validate a layer geometry and build its :class:`KNNConvPlan`.

    knn_indices: integer [K, Nout], entries in [0, nin] (nin = padding neighbour).
    rf_index: integer [Nout, K], entries in [0, v).
    """
    return KNNConvPlan(knn_indices, rf_index, nin=nin, v=v, cin=cin, cout=cout)


class NeighbourhoodPlan(GeometryPlan):
    """Sizes and tables of one per-channel neighbourhood layer: a pooling (``v`` None) or a
    depthwise convolution over ``v`` kernel cells (``rf_index`` [Nout, K] gives each slot's).

    The tables are validated here; plans with the same sizes and tables have the same handle.
    """

    def __init__(self, knn_indices, *, nin: int, rf_index=None, v: int | None = None) -> None:
        knn_indices = as_index_tensor("knn_indices", knn_indices).cpu().to(torch.int64)
        self.nin = check_positive("nin", nin)
        if (rf_index is None) != (v is None):
            raise ValueError("rf_index and v go together: both for a depthwise layer, neither "
                             "for a pooling")
        slot_cells = None
        if rf_index is None:
            check_knn_indices(knn_indices, self.nin)
            self.v = None
        else:
            rf_index = as_index_tensor("rf_index", rf_index).cpu().to(torch.int64)
            self.v = check_positive("v", v)
            check_tables(knn_indices, rf_index, self.nin, self.v)
            # padding slots read cell V, a zero the backends append to the weight
            slot_cells = torch.where(knn_indices == self.nin, self.v, rf_index.t()).contiguous()
        self.k, self.nout = knn_indices.shape
        self._host = NeighbourhoodTables(knn_indices.contiguous(), slot_cells)
        self._finish()

    def _copy_tables(self, device: torch.device) -> NeighbourhoodTables:
        host = self._host
        return NeighbourhoodTables(host.knn_indices.to(device),
                                   None if host.slot_cells is None else host.slot_cells.to(device))

    def _describe(self) -> str:
        return f"NeighbourhoodPlan(nin={self.nin}, nout={self.nout}, k={self.k}, v={self.v}"

    def _hashed_tables(self) -> tuple[torch.Tensor, ...]:
        host = self._host
        return (host.knn_indices,) if host.slot_cells is None else (host.knn_indices,
                                                                    host.slot_cells)

    @property
    def knn_indices(self) -> torch.Tensor:
        return self._host.knn_indices

    @property
    def slot_cells(self) -> torch.Tensor | None:
        return self._host.slot_cells

    def __repr__(self) -> str:
        return self.handle.split(", tables=")[0] + ")"
