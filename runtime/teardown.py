"""Destroy the process groups when a script ends cleanly, while the interpreter can still free what gloo holds.

A script that ends without ``destroy_process_group()`` (as SMP v1 scripts and most training
scripts do) leaves gloo's worker threads holding work objects with tensors; the interpreter
finalizes first, and freeing those tensors then aborts the process ("terminate called
without an active exception", SIGABRT) now and then, more often on a loaded machine (see
pytorch/pytorch#179291). smp therefore destroys the groups in an ``atexit`` handler, which
runs before finalization. It does so only after a clean run: once a transfer failed, or an
exception is leaving the program, a group may hold work that waits on a dead peer, and
destroying it could wait for the timeout; such a process exits as it did before.

A destroyed group's threads stop only when its last reference goes. smp lets go of its own
(:func:`release_at_exit`), and imports ``torch.distributed.nn.functional`` here, before any
group exists: that module's functions take ``group=group.WORLD`` as a default argument, so
importing it after ``init_process_group`` (the profiler's first dispatch mode does, through
torch._dynamo) pins the default group for the life of the process.
"""

from __future__ import annotations

import atexit
import gc
import inspect
import sys
import threading
import weakref
from collections.abc import Callable
from types import TracebackType

import torch.distributed as dist

if dist.is_available():
    import torch.distributed.nn.functional  # noqa: F401 - see above: before any group exists

__all__ = ["destroy_groups_at_exit", "release_at_exit", "mark_failed"]

_lock = threading.Lock()
_registered = False
_failed = False
#: What lets go of smp's own references to process groups (a group's threads stop only when
#: its last reference goes; destroy_process_group drops torch's). Methods are held weakly.
_releasers: list[Callable[[], Callable[[], None] | None]] = []


def mark_failed() -> None:
    """Note that a collective or transfer failed: the groups are left alone at exit."""
    global _failed
    _failed = True


def release_at_exit(release: Callable[[], None]) -> None:
    """Call ``release`` (which drops references to process groups) after the groups are destroyed at exit."""
    if inspect.ismethod(release):
        _releasers.append(weakref.WeakMethod(release))
    else:
        _releasers.append(lambda: release)


def destroy_groups_at_exit() -> None:
    """Arrange (once per process) for every process group to be destroyed at a clean exit."""
    global _registered
    with _lock:
        if _registered:
            return
        _registered = True
        previous_hook = sys.excepthook

        def note_uncaught(kind: type[BaseException], err: BaseException, tb: TracebackType | None) -> None:
            mark_failed()  # the interpreter calls this before the atexit handlers
            previous_hook(kind, err, tb)

        sys.excepthook = note_uncaught
        atexit.register(_destroy_if_clean)


def _destroy_if_clean() -> None:
    if _failed or not dist.is_available() or not dist.is_initialized():
        return
    try:
        dist.destroy_process_group()
        for get in _releasers:
            release = get()
            if release is not None:
                release()
    except Exception:  # noqa: BLE001 - exiting anyway; a group the script already tore down in part is fine
        pass
    gc.collect()  # groups in reference cycles go now, not during finalization
