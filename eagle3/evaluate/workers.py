"""Decode items in this process, or in N spawned worker processes sharing one device.

A decoder is opened once per process: ``open_decoder(*args)`` is a context manager that
yields ``decode(indices, items) -> results`` for a batch of consecutive items (at most
``batch_size``; ``args`` and results must pickle). Both paths yield ``(index, result)``
per item as batches finish; the caller puts them back in order.

Workers take batches from one shared task queue, so slow batches (long outputs,
greedy-checked prompts) balance themselves. ``spawn``, not ``fork``: a forked CUDA
context is unusable. The parent never hangs on a failed worker: an exception in a worker
comes back as one line naming the worker and the item; a worker that dies without a word
(OOM killer, segfault) is noticed by its exit code. On failure every worker is terminated;
on success every worker is joined.

Spawned workers re-import the parent's main module: a script that runs the stage in-process
needs ``if __name__ == "__main__":`` (``eagle3 stage`` and ``python -m eagle3`` are safe).
Each worker pays its own start (import torch + transformers, CUDA init: ~13 s on an H200
host, in parallel), so workers pay off when decoding takes minutes, not seconds.
"""

from __future__ import annotations

import multiprocessing
import queue
import signal
import traceback
from typing import Any, Callable, ContextManager, Iterator

import torch

from eagle3.errors import StageError

Decode = Callable[[list[int], list[Any]], list[Any]]  # (indices, items) of one batch -> results
OpenDecoder = Callable[..., ContextManager[Decode]]

POLL_S = 1.0  # how often the parent looks at its workers while no result arrives
JOIN_TIMEOUT_S = 30.0  # a worker that has sent everything but does not exit is terminated


class WorkerTraceback(Exception):
    """A worker's traceback as text: the cause of the one-line StageError (shown with EAGLE3_DEBUG=1)."""


def batches(n: int, batch_size: int) -> list[range]:
    """Item indices 0..n-1 in consecutive batches of at most ``batch_size``."""
    return [range(start, min(start + batch_size, n)) for start in range(0, n, batch_size)]


def _decode(decode: Decode, batch: range, items: list[Any]) -> list[Any]:
    results = decode(list(batch), [items[i] for i in batch])
    if len(results) != len(batch):  # a decoder bug, said plainly rather than a prompt silently missing
        raise StageError(f"decoder returned {len(results)} results for {len(batch)} items")
    return results


def decode_here(open_decoder: OpenDecoder, args: tuple, items: list[Any],
                batch_size: int = 1) -> Iterator[tuple[int, Any]]:
    """The single-process path: the decoder lives in this process, batches in order."""
    with open_decoder(*args) as decode:
        for batch in batches(len(items), batch_size):
            yield from zip(batch, _decode(decode, batch, items))


def _where(batch: range, unit: str, labels: list[int] | None) -> str:
    """The batch's items by label (their place among all items, e.g. a resumed run's prompts)."""
    names = [labels[i] for i in batch] if labels is not None else list(batch)
    if len(names) == 1:
        return f"on {unit} {names[0]}"
    if names == list(range(names[0], names[-1] + 1)):
        return f"on {unit}s {names[0]}-{names[-1]}"
    return f"on {unit}s {', '.join(map(str, names))}"


def one_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def _worker(wid: int, open_decoder: OpenDecoder, args: tuple, items: list[Any], tasks: Any, results: Any,
            current: Any, threads: int, unit: str, batch_size: int, labels: list[int] | None) -> None:
    def stop(signum: int, frame: Any) -> None:  # terminate(): unwind, so finalizers release what this process holds
        results.cancel_join_thread()  # the parent reads no more: exit must not wait on the pipe
        if working:  # afterwards the process is exiting already; raising would only interrupt that
            raise SystemExit(128 + signum)

    working = True
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent handles it, stops us
    torch.set_num_threads(threads)
    parent = multiprocessing.parent_process()
    where, todo = "while loading", batches(len(items), batch_size)
    try:
        with open_decoder(*args) as decode:
            while (i := tasks.get()) is not None:
                if parent is not None and not parent.is_alive():  # orphaned: stop, and do not wait on the pipe
                    results.cancel_join_thread()
                    return
                batch = todo[i]
                current[wid], where = i, _where(batch, unit, labels)
                results.put(("done", wid, list(batch), _decode(decode, batch, items)))
            where = "while closing"
    except Exception as e:  # reported, not raised: the parent decides, and says it in one line
        results.put(("error", wid, where, one_line(e), traceback.format_exc()))
    finally:
        working = False


def decode_in_workers(open_decoder: OpenDecoder, args: tuple, items: list[Any], workers: int,
                      stage: str = "evaluate", unit: str = "prompt", batch_size: int = 1,
                      labels: list[int] | None = None) -> Iterator[tuple[int, Any]]:
    """``workers`` spawned processes, each with its own decoder, share ``items`` in batches.

    Failures name items by ``labels`` (default: their place in ``items``).

    Torch threads are split between them (``max(1, this process's threads // workers)``) so
    CPU runs do not oversubscribe the cores. Raises :class:`StageError` on the first failure.
    Close the generator (``contextlib.closing``) to stop the workers early.
    """
    mp = torch.multiprocessing.get_context("spawn")
    tasks, results = mp.Queue(), mp.Queue()
    tasks.cancel_join_thread()  # after a failure, unread tasks may be dropped: exit must not wait on them
    todo = batches(len(items), batch_size)
    for b in range(len(todo)):
        tasks.put(b)
    for _ in range(workers):
        tasks.put(None)  # one stop sign each
    current = mp.Array("q", [-1] * workers, lock=False)  # the batch each worker took last
    threads = max(1, torch.get_num_threads() // workers)
    procs = [mp.Process(target=_worker, args=(w, open_decoder, args, items, tasks, results, current, threads, unit,
                                              batch_size, labels),
                        name=f"{stage}-worker-{w}", daemon=True) for w in range(workers)]
    for p in procs:
        p.start()
    finished = False
    try:
        pending, quiet_polls = len(items), 0
        while pending:
            try:
                msg = results.get(timeout=POLL_S)
            except queue.Empty:
                quiet_polls = _check_workers(procs, current, todo, pending, quiet_polls, stage, unit, labels)
                continue
            if msg[0] == "error":
                _, w, where, line, tb = msg
                raise StageError(f"{stage} worker {w} failed {where}: {line}") from WorkerTraceback(tb)
            _, w, indices, batch_results = msg
            pending -= len(indices)
            yield from zip(indices, batch_results)
        finished = True
    finally:
        _stop(procs, finished)


def _check_workers(procs: list[Any], current: Any, todo: list[range], pending: int, quiet_polls: int, stage: str,
                   unit: str, labels: list[int] | None) -> int:
    """Raise for a worker that died; returns the count of quiet polls since every worker exited."""
    for w, p in enumerate(procs):
        if p.exitcode not in (None, 0):
            where = _where(todo[current[w]], unit, labels) if current[w] >= 0 else "while loading"
            raise StageError(f"{stage} worker {w} died (exit code {p.exitcode}) {where}")
    if any(p.exitcode is None for p in procs):
        return 0
    if quiet_polls >= 1:  # one more poll lets the last messages of exiting workers arrive
        raise StageError(f"{stage} workers all exited with {pending} {unit}s not decoded")
    return quiet_polls + 1


def _stop(procs: list[Any], finished: bool) -> None:
    if not finished:
        for p in procs:
            p.terminate()
    for p in procs:
        p.join(JOIN_TIMEOUT_S if finished else 5.0)
        if p.is_alive():
            p.kill()
            p.join()
