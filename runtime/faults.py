"""Failing together: a pipeline's first failure published on the store, and bounded waits on peers that watch for it."""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch.distributed as dist

from runtime.errors import PipelineError

__all__ = ["ARRIVAL_DEADLINE", "FailureNote", "NotArrived", "Arrivals", "FailTogether", "failure_text",
           "wait_watching"]

#: How long (seconds) a collective call waits for every rank to enter it before naming the ranks that did not
#: (``PipelinedModel(arrival_deadline=...)``; never longer than the pipeline's ``timeout``). Short: the ranks of
#: one script reach the same call at about the same time, and one that does not usually never will.
ARRIVAL_DEADLINE = 30.0

#: The longest pause (seconds) between two looks at the store while waiting on peers.
_POLL_SECONDS = 0.1


class FailureNote:
    """Where the first rank of one pipeline that fails writes why (first writer wins), for every other rank to read.

    ``scope`` keeps pipelines apart: a pipeline made after one that failed starts with no note.
    """

    def __init__(self, store: Any, scope: str) -> None:
        self.store = store
        self.key = f"{scope}/failure"

    def publish(self, message: str) -> None:
        """Record ``message`` unless a rank already recorded its own (one atomic compare-and-set)."""
        try:
            self.store.compare_set(self.key, "", message)
        except Exception:  # noqa: BLE001 - the store may be gone with its host; nothing more to tell
            pass

    def read(self) -> str | None:
        """The failure a rank recorded, if any."""
        try:
            if self.store.check([self.key]):
                return self.store.get(self.key).decode(errors="replace")
        except Exception:  # noqa: BLE001 - the store is gone: no note to read
            return None
        return None


def failure_text(rank: int, err: BaseException) -> str:
    """What the other ranks are told when ``err`` stops rank ``rank``: its type and message (without a leading
    "rank N: " that names this rank again)."""
    text = str(err).strip()
    own = f"rank {rank}: "
    if text.startswith(own):
        text = text[len(own):]
    return f"rank {rank} failed: {type(err).__name__}: {text}" if text else f"rank {rank} failed: {type(err).__name__}"


class NotArrived(Exception):
    """Some ranks did not enter a collective call within its deadline (``absent``), or the store is gone."""

    def __init__(self, absent: Sequence[int], seconds: float, store_error: BaseException | None = None) -> None:
        self.absent = list(absent)
        self.seconds = seconds
        if store_error is not None:
            text = (f"the store the ranks meet on is gone ({type(store_error).__name__}: {store_error}): the rank "
                    "hosting it exited or crashed")
        else:
            who = f"rank{'s' if len(self.absent) > 1 else ''} {', '.join(map(str, self.absent))}"
            text = f"{who} did not call it within {seconds:g} s"
        super().__init__(text)


def wait_watching(ready: Callable[[], bool], seconds: float, note: FailureNote | None, me: int,
                  waiting_for: str) -> bool:
    """Poll ``ready()`` until it holds (True) or ``seconds`` pass (False); a failure another rank publishes on
    ``note`` meanwhile raises :class:`PipelineError` with its message at once."""
    deadline = time.monotonic() + seconds
    pause = 0.001
    while True:
        if ready():
            return True
        cause = note.read() if note is not None else None
        if cause is not None:
            if ready():  # what was awaited came first; the failure is someone else's to report
                return True
            raise PipelineError(f"{cause} (rank {me} stopped waiting for {waiting_for})", rank=me)
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(pause * 2, _POLL_SECONDS)


class Arrivals:
    """Checks that every rank entered the same collective call, on the store: no transfer over the data path.

    Each rank counts its calls of each collective and writes the count under its own key
    (``<scope>/arrived/<what>/<rank>``: one key per rank and collective, however many calls);
    a call waits until every rank's count has reached its own. Every rank makes the same
    collective calls in the same order, so the n-th call of one is the n-th of the others.
    """

    def __init__(self, store: Any, scope: str, rank: int, note: FailureNote | None = None) -> None:
        self.store = store
        self.scope = scope
        self.rank = rank
        self.note = note
        self.counts: dict[str, int] = {}

    def meet(self, what: str, ranks: Sequence[int], seconds: float) -> None:
        """Enter collective ``what`` over global ``ranks``; raises :class:`NotArrived` naming the ranks that did not
        within ``seconds`` (the caller says what to do), :class:`PipelineError` if a rank published a failure."""
        if len(ranks) <= 1:
            return
        n = self.counts[what] = self.counts.get(what, 0) + 1
        keys = {r: f"{self.scope}/arrived/{what}/{r}" for r in ranks}
        try:
            self.store.set(keys[self.rank], str(n))
            waiting = [r for r in ranks if r != self.rank]

            def all_arrived() -> bool:  # a count only grows: a rank seen arrived is not asked again
                waiting[:] = [r for r in waiting if not (self.store.check([keys[r]])
                                                         and int(self.store.get(keys[r])) >= n)]
                return not waiting

            if wait_watching(all_arrived, seconds, self.note, self.rank, f"the other ranks at {what}") \
                    or all_arrived():  # the last may have come as the deadline passed
                return
            absent = list(waiting)
        except PipelineError:
            raise
        except Exception as err:  # noqa: BLE001 - the store's host died
            raise NotArrived([], seconds, err) from None
        raise NotArrived(absent, seconds)


class FailTogether:
    """One pipeline's ranks failing together: its failure note and arrival checks on the default group's store.

    Without a store (one process, or a group made without one) every part is a no-op: no rank can tell another
    why it failed, nor check that every rank entered a collective.
    """

    #: This process's pipelines, numbered: every rank makes its pipelines in the same order, so the n-th is the
    #: same pipeline everywhere, with the same keys on the store; a new pipeline starts with no failure noted.
    _numbers = itertools.count()

    def __init__(self, rank: int, world_size: int, *, timeout: float, arrival_deadline: float,
                 distributed: bool) -> None:
        scope = f"smp/pipeline/{next(self._numbers)}"
        store = _default_store() if distributed else None
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.arrival_deadline = arrival_deadline
        self.note = FailureNote(store, scope) if store is not None else None
        self.arrivals = Arrivals(store, scope, rank, self.note) if store is not None else None
        #: The pipeline's communicator once set up (``runtime.comm.Comm``): a failure is then told through it, which
        #: also closes the connections a peer may be blocked on.
        self.comm: Any = None

    @contextlib.contextmanager
    def failing(self) -> Iterator[None]:
        """Run part of the set-up, a step or a collective call; if it fails on this rank, tell the others why
        (each raises it at its next wait on a peer) and raise the error as it is."""
        try:
            yield
        except Exception as err:
            text = failure_text(self.rank, err)
            if self.comm is not None:
                self.comm.report_failure(text)
            elif self.note is not None:
                self.note.publish(text)
            raise

    @contextlib.contextmanager
    def collective(self, what: str, hint: str) -> Iterator[None]:
        """A collective call: every rank must enter it within ``arrival_deadline`` (and ``timeout``); one that does
        not is named, with ``hint`` (what to do instead). Fails together (:meth:`failing`)."""
        with self.failing():
            if self.arrivals is not None:
                try:
                    self.arrivals.meet(what, range(self.world_size), min(self.arrival_deadline, self.timeout))
                except NotArrived as err:
                    raise PipelineError(f"{what} is collective: {err}" + (f"; {hint}" if err.absent else ""),
                                        rank=self.rank) from None
            yield

    def meet_after_setup(self) -> None:
        """Wait (at most ``timeout``) until every rank has set up as this one just did: a rank whose set-up failed
        has told why, and every other rank raises it here instead of waiting on it in the first step."""
        if self.arrivals is None:
            return
        try:
            self.arrivals.meet("set-up", range(self.world_size), self.timeout)
        except NotArrived as err:
            if not err.absent:
                raise PipelineError(f"setting up the pipeline: {err}", rank=self.rank) from None
            who = f"rank{'s' if len(err.absent) > 1 else ''} {', '.join(map(str, err.absent))}"
            raise PipelineError(f"{who} did not finish setting up the pipeline within {err.seconds:g} s: dead or "
                                "stuck, or not making the same first step(), call or prepare() as this rank",
                                rank=self.rank) from None


def _default_store() -> Any:
    """The default process group's rendezvous store; None for a group made without one."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - a custom init without a store
        return None
