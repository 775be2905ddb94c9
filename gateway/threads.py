"""The gateway's few database calls run on a small pool of threads, never on the event loop."""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor

from django.db import close_old_connections

_executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="gateway-db")


def _call(fn, *args, **kwargs):
    close_old_connections()  # drop a connection past its age or broken since the last call
    return fn(*args, **kwargs)


async def run_db(fn, *args, **kwargs):
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_executor, functools.partial(_call, fn, *args, **kwargs))
