"""Console-script entry points: run a click command, then leave without the interpreter's teardown.

A process that imported torch and transformers spends 0.5 s (pack-data on chat data, pack-verify
--deep) to 1.0-1.3 s (pack-train) of wall time in interpreter shutdown on the 2-core dev machine,
after all its work is done and its output is in place (BENCHMARKS.md, "whole processes").
`run_and_exit` keeps what a normal exit does for us: the exit status, the atexit handlers (the
tokenizer worker pool, multiprocessing's children, logging), flushed stdout/stderr, and the wait for
running non-daemon threads; only the module teardown and C++ static destructors are skipped. The
commands themselves stay ordinary click commands, so tests invoke them in process.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn

import click


def run_and_exit(command: click.Command, prog_name: str) -> NoReturn:
    """Run `command` on sys.argv as a console script and exit the process with its status.

    An exception click does not handle (a bug) propagates as usual, traceback included. If a thread
    that a normal exit would wait for is still running, the process exits the normal way.
    """
    try:
        command.main(prog_name=prog_name)  # standalone mode: ends in SystemExit, whatever happened
        code: object = 0
    except SystemExit as exc:
        code = exc.code
    if code is None:
        code = 0
    elif not isinstance(code, int):  # sys.exit("message") semantics
        print(code, file=sys.stderr)
        code = 1
    main = threading.main_thread()
    if any(t is not main and not t.daemon and t.is_alive() for t in threading.enumerate()):
        sys.exit(code)
    atexit._run_exitfuncs()  # the handlers a normal exit runs (CPython's, long stable), in order
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`pack-data ... | head`): nothing to flush to
            pass
    os._exit(code)
