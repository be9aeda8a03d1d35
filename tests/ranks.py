"""Running a test's body on several processes joined in a process group.

`spawn(body, world, *args)` starts `world` processes; each joins the group, runs
`body(rank, world, *args)`, waits at a barrier and marks itself done. Gloo's threads sometimes
abort a process as it exits on a loaded machine ("terminate called without an active
exception", SIGABRT), after the body's checks and the barrier: that is not the test's failure,
so it passes when every rank had marked itself done. Anything else, before or after, fails it.
"""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank, world, init_file, done_dir, backend, body, args):
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    try:
        if backend == "gloo":
            torch.set_num_threads(1)
        body(rank, world, *args)
        dist.barrier()
        open(os.path.join(done_dir, f"rank-{rank}"), "w").close()  # every check passed
    finally:
        dist.destroy_process_group()


def spawn(body, world, *args, backend="gloo"):
    """Run `body(rank, world, *args)` on `world` processes in one process group."""
    fd, init_file = tempfile.mkstemp(prefix="fh-ranks-")
    os.close(fd)
    os.unlink(init_file)
    with tempfile.TemporaryDirectory(prefix="fh-ranks-done-") as done_dir:
        try:
            mp.spawn(_entry, args=(world, init_file, done_dir, backend, body, args),
                     nprocs=world, join=True)
        except mp.ProcessExitedException as exc:
            done = set(os.listdir(done_dir))
            if exc.signal_name != "SIGABRT" or done != {f"rank-{r}" for r in range(world)}:
                raise
        finally:
            if os.path.exists(init_file):
                os.unlink(init_file)
