"""Optional host-side profile of a node process's main loop, for finding where its time goes.

With PDSERVE_PROFILE_DIR set, `profiled(role)` runs the body under cProfile and, when it ends
(a node's loop ends on SIGTERM/SIGINT), writes `<dir>/<role>-<pid>.prof` (load it with pstats
or snakeviz) and `<role>-<pid>.txt`, the top functions by own time. Threads other than the
caller's (the heartbeat) are not profiled.
"""

from __future__ import annotations

import cProfile
import io
import logging
import os
import pstats
from collections.abc import Iterator
from contextlib import contextmanager

from common import envs

log = logging.getLogger(__name__)

TOP_FUNCTIONS = 40


@contextmanager
def profiled(role: str) -> Iterator[None]:
    directory = envs.profile_dir()
    if directory is None:
        yield
        return
    profile = cProfile.Profile()
    profile.enable()
    try:
        yield
    finally:
        profile.disable()
        directory.mkdir(parents=True, exist_ok=True)
        stem = directory / f"{role}-{os.getpid()}"
        profile.dump_stats(f"{stem}.prof")
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(TOP_FUNCTIONS)
        stem.with_suffix(".txt").write_text(text.getvalue())
        log.info("wrote the %s node's profile to %s.prof", role, stem)
