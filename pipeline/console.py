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


def pack_data_main() -> NoReturn:
    """The `pack-data` console script. Its first act is to fork the child that loads the tokenizer
    (`tokenizer_cache.prefetch`, unless the cache has it), so that the child's 1-2 s of imports
    overlap this process's own (the command's modules: numba, pyarrow). Its process loads no model
    and compiles no numba code that needs a BLAS: transformers (imported here for chat data only)
    loads without torch, and numba's probe for a BLAS (an import of SciPy's linear algebra) is
    skipped (`binpack.load_kernels`)."""
    from pipeline import tokenizer_cache
    from pipeline.tokenizer_load import hide_torch

    hide_torch()
    if not {"-h", "--help"} & set(sys.argv[1:]):
        name = _option_value(sys.argv[1:], "--tokenizer")
        if name:
            tokenizer_cache.prefetch(name)
    from pipeline import binpack
    from pipeline.cli import pack_data

    binpack.NUMBA_BLAS_PROBE = False
    run_and_exit(pack_data, "pack-data")


def _option_value(argv: list[str], option: str) -> str | None:
    """The value given to `option` in `argv` (`--opt value` or `--opt=value`), else None."""
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        if arg == option and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(option + "="):
            return arg[len(option) + 1:]
    return None
