"""Progress of long runs: a bar on a terminal, one line per finished item otherwise.

Without a terminal (a log file, CI, a pipe) a bar is either carriage-return noise or nothing,
so each finished item becomes a line on the ``hilt`` logger instead::

    [3/12] model.layers.2.mlp.up_proj.weight ... 1.4s  2.250 bits/weight, rel. error 0.0312

The command line sends that logger to its output and silences it with -q; a library call
that leaves logging unconfigured gets no lines. Imports nothing of the project.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time

LOG = logging.getLogger("hilt")


def interactive() -> bool:
    """Someone is watching: stdout and stderr (where a bar is drawn) are both terminals."""
    return sys.stdout.isatty() and sys.stderr.isatty()


class Progress:
    """``total`` items, each made of ``steps`` sub-steps (``tick``) that only the bar shows.

    ``done(name, detail)`` ends an item: without a terminal it logs ``[i/N] name ... 1.2s  detail``;
    on one it moves the bar (and with ``echo`` also logs ``name  detail`` above it).
    ``enabled=False`` shows nothing at all.
    """

    def __init__(self, total: int, desc: str, unit: str = "item", *, steps: int = 1, initial: int = 0,
                 enabled: bool = True, echo: bool = False):
        self.total, self.count, self.steps, self.echo = total, initial, max(1, steps), echo
        self._ticks = 0
        self._last = time.perf_counter()
        self._bar = None
        self._lines = enabled and not interactive()
        if enabled and not self._lines and LOG.level <= logging.INFO:  # -q sets the level above INFO
            from tqdm import tqdm

            self._bar = tqdm(total=total * self.steps, initial=initial * self.steps, desc=desc,
                             unit=unit if self.steps == 1 else "step", dynamic_ncols=True, file=sys.stderr)

    def tick(self, n: int = 1, **postfix) -> None:
        if self._bar is not None:
            self._bar.update(n)
            self._ticks += n
            if postfix:
                self._bar.set_postfix(refresh=False, **postfix)

    def done(self, name: str, detail: str = "") -> None:
        self.count += 1
        now = time.perf_counter()
        seconds, self._last = now - self._last, now
        if self._bar is not None:
            if self._ticks < self.steps:
                self._bar.update(self.steps - self._ticks)
            self._ticks = 0
            self._bar.set_postfix_str(name if self.echo else detail or name, refresh=False)
            if self.echo and detail:
                LOG.info(f"{name}  {detail}")
        elif self._lines:
            LOG.info(f"[{self.count}/{self.total}] {name} ... {seconds:.1f}s" + (f"  {detail}" if detail else ""))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextlib.contextmanager
def quiet():
    """Drop the info lines logged on the ``hilt`` logger inside (warnings still pass): for a caller that
    runs a task only for its numbers and reports them in its own lines."""

    def warnings_only(record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING

    LOG.addFilter(warnings_only)
    try:
        yield
    finally:
        LOG.removeFilter(warnings_only)


class Handler(logging.StreamHandler):
    """A stream handler that writes above a running tqdm bar rather than through it."""

    def emit(self, record: logging.LogRecord) -> None:
        tqdm = sys.modules.get("tqdm")
        if tqdm is None or not getattr(tqdm.tqdm, "_instances", None):
            super().emit(record)
            return
        try:
            tqdm.tqdm.write(self.format(record), file=self.stream)
        except Exception:  # noqa: BLE001 (logging's own contract: never raise from emit)
            self.handleError(record)
