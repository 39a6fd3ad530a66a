"""`hilt quantize --ray`: the writer's tensor jobs as Ray tasks, on a local Ray instance or the cluster
at RAY_ADDRESS (as `hilt sweep --ray` does).

Each task opens the source itself (so the source path must be readable where the workers run: the same
machine, or a shared file system), reads one tensor, quantizes it and returns its packed parts; this
process writes the shards in file order, as a local run does, so the bytes are the same. Every task
holds one of Ray's CPUs and runs one torch thread: a tensor's bytes do not depend on how many threads
made them (tests/test_quantize.py), so N workers are N tensors at once on N cores. A worker that dies
takes its task with it; Ray runs that task again on another worker
(``max_retries``), and an interrupted run continues with `hilt quantize --resume` as without Ray.
"""

from __future__ import annotations

import logging
import os
import socket

from hilt.errors import HiltError
from hilt.progress import LOG

RETRIES = 3  # runs of a task after its worker died


def import_ray():
    try:
        import ray
    except ImportError:
        raise HiltError("--ray needs Ray: pip install 'hilt[ray]'") from None
    return ray


def check_reachable(address: str, seconds: float = 3.0) -> None:
    """Refuse a RAY_ADDRESS nothing answers at, at once: ray.init would wait minutes on it."""
    if address in ("auto", "local"):
        return
    host, _, port = address.removeprefix("ray://").rstrip("/").rpartition(":")
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=seconds).close()
    except ValueError:
        raise HiltError(f"RAY_ADDRESS={address}: not HOST:PORT") from None
    except OSError as e:
        raise HiltError(f"cannot reach the Ray cluster at RAY_ADDRESS={address} ({e.strerror or e})") from None


def _run_job(fn, path, *args):
    import torch

    torch.set_num_threads(1)  # the task's one CPU
    return fn(path, *args)


class _Job:
    def __init__(self, ray, ref):
        self._ray, self._ref = ray, ref

    def result(self):
        try:
            return self._ray.get(self._ref)
        except self._ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, HiltError):
                raise cause from None
            raise HiltError(f"a Ray task failed: {str(e).strip().splitlines()[-1]}") from None
        except self._ray.exceptions.RayError as e:  # its worker died more than RETRIES times, the cluster went away
            raise HiltError(f"a Ray task was lost ({type(e).__name__}); continue with --resume") from None


class RayPool:
    """``submit(fn, source, *args)`` as a Ray task ``fn(source.path, *args)``; a context manager that
    joins (or starts) the cluster and leaves it (or stops it) afterwards. ``workers``: tasks at a time
    (default: the cluster's CPUs)."""

    def __init__(self, workers: int | None = None):
        self.workers = workers
        self.jobs_ahead = 2
        self._started = False

    def __enter__(self):
        ray = self._ray = import_ray()
        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS")
            if address:
                check_reachable(address)
            try:
                if address:
                    ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
                else:
                    ray.init(num_cpus=self.workers or os.cpu_count(), include_dashboard=False,
                             logging_level=logging.ERROR, log_to_driver=False)
            except (ConnectionError, TimeoutError) as e:
                raise HiltError(f"cannot reach the Ray cluster at RAY_ADDRESS={address} ({e})") from None
            except Exception as e:  # ray raises several kinds for an address it cannot use
                raise HiltError(f"cannot start or join a Ray cluster{f' at RAY_ADDRESS={address}' if address else ''} "
                                f"({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''})") from None
            self._started = True
        cpus = int(ray.cluster_resources().get("CPU", 1))
        slots = min(self.workers or cpus, cpus)
        # as many queued as running where the cluster's CPUs bound what runs: a freed CPU starts the next task
        # at once, even while the driver waits on the tensor next in file order (a queued task holds no
        # tensor, a result is small); on a larger cluster, exactly --workers in flight
        self.jobs_ahead = 2 * slots if slots == cpus else slots
        self._remote = ray.remote(_run_job).options(num_cpus=1, max_retries=RETRIES)
        LOG.info(f"Ray: {cpus} CPUs, {slots} tensors at a time")
        return self

    def submit(self, fn, source, *args) -> _Job:
        return _Job(self._ray, self._remote.remote(fn, str(source.path), *args))

    def __exit__(self, *exc):
        if self._started:
            self._ray.shutdown()
