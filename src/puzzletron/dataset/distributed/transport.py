"""Moving a built batch from a DataLoader worker to the trainer: every tensor in one reused shared-memory
segment, the rest pickled small.

A DataLoader worker hands its result to the trainer through a multiprocessing queue whose pickler
(``torch.multiprocessing``'s ``ForkingPickler``) moves each tensor's storage into a fresh shared-memory
segment and sends that segment's file descriptor over a socket: per tensor a copy into new pages, the
kernel's page faults and zeroing for every page of them, and a descriptor exchange (about 0.6 ms of CPU
here). A `PuzzletronBatch` holds about twenty tensors and a pack's pixels are tens of MB, so that was
most of what a worker cost beyond building the batch (``benchmarks/bench_vlm_cpu.py``).

`SharedTensors(value)` is what a worker returns instead. Pickling it finds every CPU tensor of `value`
(pickling `value` with a ``persistent_id`` hook: nested in dicts, dataclasses, a batch's state), copies
them into one segment of the worker's pool, 64-byte aligned, and pickles the rest of `value` with each
tensor replaced by its index: a few kilobytes and one descriptor cross. The pool (`_Pool`, one per worker
process) keeps up to `POOL_SIZE` segments (``memfd_create``) mapped, so a segment's pages are faulted in
once and reused batch after batch; the trainer keeps its mappings too (`_MAPPINGS`, keyed by the file's
identity). Unpickling rebuilds `value` itself, each tensor a view of the segment with its dtype and shape
(contiguous; the same values, so the same fingerprint).

A segment is handed out again only when the trainer is done with it: byte 0 of its header is 1 from the
moment the worker fills it until every tensor (and every view, slice or ``.numpy()`` array) of the batch
unpickled from it is gone in the trainer, which a ``weakref.finalize`` on the buffer object all of them
hold notices and writes 0. No segment free and the pool full: a one-off segment, dropped with the batch.
Without ``memfd_create`` (not Linux) torch's own shared memory carries the one block instead.

A batch's largest tensor (a pack's ``pixel_values``, tens of MB) need not be copied at all: a worker
that `place_in_segments` (every `batch_loader` worker) builds it in `batch_buffer`, room at the start of a
free segment of its pool, and pickling finds it there and leaves it in place (the other tensors are copied
after it). The copy it saves is a memcpy of every pixel byte (about 2 us an image token in bfloat16 on one
core here). The room is the batch's until the batch crosses (then the trainer's, as above) or, when it never
does, until the last view of it in the worker is gone.

Any picklable value works, so a client's own ``collate_fn`` output (the HF Trainer's kwargs dict) takes
the same path; `shared_collate` wraps a collate function so that it returns `SharedTensors` in a worker
process and the plain value in the main process. Pickles are the worker's own (trusted:
``docs/trust-model.md``); nothing here reads a pickle from disk.
"""

from __future__ import annotations

import ctypes
import io
import mmap
import os
import pickle
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from multiprocessing import reduction
from typing import Any

import numpy as np
import torch

__all__ = ["POOL_SIZE", "SharedTensors", "batch_buffer", "place_in_segments", "shared_collate"]

POOL_SIZE = 6  # segments a worker keeps: the batches in flight (prefetch 2) + those the trainer holds
_ALIGN = 64  # every tensor starts on a cache line (and so on its element size)
_HEADER = mmap.PAGESIZE  # byte 0: 1 while the trainer may read the segment; the tensors start after
_GROWTH = 1 << 20  # segments are sized in MiB, a quarter above the batch that created them
_MAPPINGS: OrderedDict[tuple[int, int], mmap.mmap] = OrderedDict()  # trainer side: (dev, inode) -> map
_MAX_MAPPINGS = 64
_MIN_PLACED = 1 << 20  # smaller tensors are cheaper to copy than a segment is to hold
_ROOM = 4 << 20  # a placed segment's room for the batch's other tensors, at least
_PLACING = False  # `batch_buffer` may place (set in the workers of `batch_loader`)

Spec = tuple[int, torch.dtype, tuple[int, ...]]


def _movable(obj: Any) -> bool:
    """A plain dense CPU tensor without autograd history (what a segment can hold as raw bytes)."""
    return (
        type(obj) is torch.Tensor
        and obj.device.type == "cpu"
        and obj.layout is torch.strided
        and not obj.requires_grad
        and not obj.is_quantized
    )


class _Collecting(pickle.Pickler):
    """Pickles a value with each movable tensor replaced by its index in `tensors`."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []
        self._seen: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> int | None:
        if not _movable(obj):
            return None
        index = self._seen.get(id(obj))
        if index is None:  # the same tensor object twice: one copy, one index
            index = self._seen[id(obj)] = len(self.tensors)
            self.tensors.append(obj)
        return index


class _Restoring(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, tensors: Sequence[torch.Tensor]) -> None:
        super().__init__(file)
        self._tensors = tensors

    def persistent_load(self, pid: Any) -> torch.Tensor:
        return self._tensors[pid]


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _specs(
    tensors: Sequence[torch.Tensor], placed: Sequence[int | None] = (), start: int = 0
) -> tuple[list[Spec], int]:
    """``(offset, dtype, shape)`` of each tensor in a segment's payload and the payload's size: a tensor
    with an offset in `placed` stays there, the others follow `start` (aligned)."""
    specs, end = [], _aligned(start)
    placed = list(placed) or [None] * len(tensors)
    for t, at in zip(tensors, placed, strict=True):
        if at is None:
            specs.append((end, t.dtype, tuple(t.shape)))
            end += _aligned(t.numel() * t.element_size())
        else:
            specs.append((at, t.dtype, tuple(t.shape)))
    return specs, end


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=np.int64)) * torch.empty(0, dtype=dtype).element_size()


def _views(buffer: Any, specs: Sequence[Spec]) -> list[torch.Tensor]:
    """Each ``(offset, dtype, shape)`` of `specs` as a tensor over the writable bytes-like `buffer`."""
    out = []
    for offset, dtype, shape in specs:
        raw = np.frombuffer(buffer, np.uint8, count=_nbytes(dtype, shape), offset=offset)
        out.append(torch.from_numpy(raw).view(dtype).view(shape))
    return out


class _Segment:
    """One memfd of `capacity` payload bytes after the header (byte 0: in use; bytes 8..16: the worker's
    pid), mapped in the worker."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.fd = os.memfd_create("puzzletron-batch", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, _HEADER + capacity)
        self.map = mmap.mmap(self.fd, _HEADER + capacity)
        self.map[8:16] = os.getpid().to_bytes(8, "little")
        self.base = ctypes.addressof(ctypes.c_uint8.from_buffer(self.map, _HEADER))  # the payload's address
        self.placed = 0  # bytes at the payload's start that a batch being built here holds
        self.viewed = False  # a view of them is alive in this process
        self.sent = False  # ... and they crossed (the trainer releases them)

    @property
    def free(self) -> bool:
        return self.map[0] == 0 and not self.viewed

    def place(self, nbytes: int) -> np.ndarray:
        """Room for `nbytes` at the payload's start, the segment in use until it crosses or is dropped."""
        self.map[0] = 1
        self.placed, self.viewed, self.sent = nbytes, True, False
        holder = (ctypes.c_uint8 * nbytes).from_buffer(self.map, _HEADER)
        weakref.finalize(holder, self._unviewed)  # every view of the room holds `holder`
        return np.frombuffer(holder, np.uint8)

    def _unviewed(self) -> None:
        self.viewed = False
        if not self.sent and not self.map.closed:  # dropped before it crossed: free again
            self.map[0] = 0

    def offset_of(self, tensor: torch.Tensor) -> int | None:
        """Where `tensor` lies in the room of a batch being built here (contiguous, inside it), or None."""
        if not self.viewed or self.sent or not tensor.is_contiguous():
            return None
        at, size = tensor.data_ptr() - self.base, tensor.numel() * tensor.element_size()
        return at if at >= 0 and at + size <= self.placed and at % tensor.element_size() == 0 else None

    def fill(
        self, specs: Sequence[Spec], tensors: Sequence[torch.Tensor], placed: Sequence[int | None] = ()
    ) -> None:
        """Mark the segment in use and copy `tensors` to their places (but those already `placed`)."""
        self.map[0] = 1
        payload = (ctypes.c_uint8 * self.capacity).from_buffer(self.map, _HEADER)
        placed = list(placed) or [None] * len(tensors)
        for view, tensor, at in zip(_views(payload, specs), tensors, placed, strict=True):
            if at is not None:
                continue
            if tensor.is_contiguous():  # glibc's memcpy: about twice torch's copy_ on large blocks
                ctypes.memmove(view.data_ptr(), tensor.data_ptr(), tensor.numel() * tensor.element_size())
            else:
                view.copy_(tensor)

    def close(self) -> None:
        self.map.close()
        os.close(self.fd)


class _Pool:
    """The segments of one worker process (created on its first batch)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.segments: list[_Segment] = []

    def take(self, size: int) -> tuple[_Segment, bool]:
        """A segment for `size` payload bytes, and whether the pool keeps it (else a one-off)."""
        free = [s for s in self.segments if s.free]
        fits = [s for s in free if s.capacity >= size]
        if fits:
            return min(fits, key=lambda s: s.capacity), True
        if len(self.segments) >= POOL_SIZE and free:  # too small: replaced by a larger one
            smallest = min(free, key=lambda s: s.capacity)
            self.segments.remove(smallest)
            smallest.close()
        segment = _Segment(max(-(-size * 5 // 4 // _GROWTH), 1) * _GROWTH)
        if len(self.segments) >= POOL_SIZE:  # every segment is in the trainer's hands
            return segment, False
        self.segments.append(segment)
        return segment, True

    def place(self, nbytes: int) -> np.ndarray | None:
        """Room for `nbytes` at the start of a pooled segment (with room for the batch's other tensors
        after it), or None when every segment is taken."""
        segment, pooled = self.take(nbytes + max(nbytes // 8, _ROOM))
        if not pooled:
            segment.close()
            return None
        return segment.place(nbytes)

    def home(self, tensors: Sequence[torch.Tensor]) -> tuple[_Segment, list[int | None]] | None:
        """The segment whose room holds some of `tensors`, with each one's offset there (None: not)."""
        for segment in self.segments:
            offsets = [segment.offset_of(t) for t in tensors]
            if any(at is not None for at in offsets):
                return segment, offsets
        return None


_POOL: _Pool | None = None


def _pool() -> _Pool:
    global _POOL
    if _POOL is None or _POOL.pid != os.getpid():  # a forked child starts its own
        _POOL = _Pool()
    return _POOL


def place_in_segments(worker_id: int | None = None) -> None:
    """Let `batch_buffer` build tensors in this process's segments: for a DataLoader worker all of whose
    batches cross as `SharedTensors` (`batch_loader` runs it as part of its ``worker_init_fn``)."""
    global _PLACING
    _PLACING = hasattr(os, "memfd_create")


def batch_buffer(nbytes: int) -> np.ndarray:
    """A writable uint8 array ``[nbytes]`` to build a batch's large tensor in (a pack's pixels): where
    `place_in_segments` ran, room in a free segment of this worker's pool, so that the tensor crosses in
    place; else (or under 1 MiB, or every segment taken) ``np.empty``."""
    if _PLACING and nbytes >= _MIN_PLACED:
        room = _pool().place(nbytes)
        if room is not None:
            return room
    return np.empty(nbytes, dtype=np.uint8)


def _release(mapping: mmap.mmap) -> None:
    """The trainer is done with a segment's batch: the worker may fill it again."""
    if not mapping.closed:
        mapping[0] = 0


def _alive(mapping: mmap.mmap) -> bool:
    """Whether the worker that owns a mapped segment still runs (its pid is in the header)."""
    if mapping.closed:
        return False
    try:
        os.kill(int.from_bytes(mapping[8:16], "little"), 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process reuses the pid: not ours any more
        return False
    return True


def _mapping(fd: int, size: int, pooled: bool) -> mmap.mmap:
    """The trainer's mapping of the segment `fd`; a pooled one is kept (its pages stay mapped for the
    segment's next batch) until its worker exits or `_MAX_MAPPINGS` newer ones are kept."""
    if not pooled:
        return mmap.mmap(fd, size)
    st = os.fstat(fd)
    key = (st.st_dev, st.st_ino)
    mapping = _MAPPINGS.get(key)
    if mapping is None or mapping.closed or len(mapping) != size:
        for old in [k for k, m in _MAPPINGS.items() if not _alive(m)]:
            del _MAPPINGS[old]  # a live batch keeps its own reference
        mapping = _MAPPINGS[key] = mmap.mmap(fd, size)
        while len(_MAPPINGS) > _MAX_MAPPINGS:
            _MAPPINGS.popitem(last=False)
    _MAPPINGS.move_to_end(key)
    return mapping


def _restore(data: bytes, specs: list[Spec], shared: Any, size: int, pooled: bool) -> Any:
    """The value `SharedTensors.__reduce__` packed: `data` unpickled with its tensors as views of the
    segment `shared` (a descriptor to receive, of `size` bytes) or of the torch block `shared`."""
    if isinstance(shared, torch.Tensor):
        views = [shared[o : o + _nbytes(d, s)].view(d).view(s) for o, d, s in specs]
    else:
        fd = shared.detach()
        try:
            mapping = _mapping(fd, size, pooled)
        finally:
            os.close(fd)
        holder = (ctypes.c_uint8 * (size - _HEADER)).from_buffer(mapping, _HEADER)
        weakref.finalize(holder, _release, mapping)  # when the last tensor of this batch is gone
        views = _views(holder, specs)
    return _Restoring(io.BytesIO(data), views).load()


class SharedTensors:
    """`value`, pickled with all its CPU tensors in one shared-memory segment (module docstring);
    unpickling gives `value` back, not a `SharedTensors`."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        buffer = io.BytesIO()
        pickler = _Collecting(buffer)
        pickler.dump(self.value)
        specs, size = _specs(pickler.tensors)
        if not hasattr(os, "memfd_create"):
            block = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(max(size, 1)))
            for (o, d, s), tensor in zip(specs, pickler.tensors, strict=True):
                block[o : o + _nbytes(d, s)].view(d).view(s).copy_(tensor)
            return (_restore, (buffer.getvalue(), specs, block, 0, False))
        pool, tensors = _pool(), pickler.tensors
        home = pool.home(tensors)
        if home is not None:  # built in place: only the other tensors are copied, after it
            specs, size = _specs(tensors, home[1], home[0].placed)
            if size <= home[0].capacity:
                home[0].sent = True
                home[0].fill(specs, tensors, home[1])
                shared = reduction.DupFd(home[0].fd)
                return (_restore, (buffer.getvalue(), specs, shared, _HEADER + home[0].capacity, True))
            specs, size = _specs(tensors)
        segment, pooled = pool.take(size)
        segment.fill(specs, tensors)
        shared = reduction.DupFd(segment.fd)  # a duplicate of the descriptor crosses
        if not pooled:
            segment.close()
        return (_restore, (buffer.getvalue(), specs, shared, _HEADER + segment.capacity, pooled))


class _SharedCollate:
    """`collate_fn`'s result as `SharedTensors` in a DataLoader worker, as it is in the main process."""

    def __init__(self, collate_fn: Callable[[Any], Any]) -> None:
        self.collate_fn = collate_fn

    def __call__(self, items: Any) -> Any:
        value = self.collate_fn(items)
        return SharedTensors(value) if torch.utils.data.get_worker_info() is not None else value


def shared_collate(collate_fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """`collate_fn`, returning its value through `SharedTensors` when it runs in a DataLoader worker."""
    return collate_fn if isinstance(collate_fn, _SharedCollate) else _SharedCollate(collate_fn)
