"""The ``dafka`` command line.

One module per command or command group (``tower``, ``produce``, ``consume``,
``store`` and ``topics``, ``gateway`` and ``tank``, ``status``, ``console``,
``outbox``, ``doctor``, ``up``, ``keys``, ``bench``), each with its function and
its part of the parser; :mod:`dafka.cli.parser` assembles them, what they share
is in :mod:`dafka.cli.common` and :mod:`dafka.cli.args`.
Tower addresses come from ``--tower`` (repeatable, or comma-separated), the
TOML file of ``--config`` / ``$DAFKA_CONFIG``, or ``$DAFKA_TOWERS``; with none
of them the tower on 127.0.0.1 is used.

Errors a user can act on (bad option values, paths, addresses, missing peers)
print one ``error: ...`` line on stderr, no traceback.  Exit codes: 0 done,
1 runtime failure, 2 usage or configuration error, 130 interrupted (Ctrl-C),
141 the reader of stdout went away.
"""

from __future__ import annotations

import errno
import logging
import multiprocessing
import os
import signal
import sys

from dafka.config import load_settings
from dafka.errors import ConfigError, DafkaError, ResumeError

if getattr(multiprocessing.current_process(), "_inheriting", False):
    # A process spawned by a command (the benchmarks' nodes) imports this
    # module first: Ctrl-C reaches the whole process group, and only the
    # parent handles it (it stops its children), so no child prints a
    # KeyboardInterrupt traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

from dafka.cli.common import (  # noqa: E402  (after the signal guard: the commands' modules load more)
    EXIT_BROKEN_PIPE,
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_NOT_STARTED,
    EXIT_USAGE,
    IN_USE_HINT,
    node_config,
)
from dafka.cli.parser import COMMANDS, build_parser, option_before_command  # noqa: E402

__all__ = ["build_parser", "main", "node_config", "option_before_command"]

log = logging.getLogger("dafka.cli")


# zmq errnos of a bind/connect the user can fix (address in use, no such interface, ...).
_ADDRESS_ERRNOS = {errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.ENODEV, errno.EACCES, errno.EINVAL}


def _error(message: object, code: int) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    """Run one command.  Known failures become one ``error:`` line; bugs keep their traceback."""
    import zmq

    try:
        parser = build_parser()
        misplaced = option_before_command(parser, sys.argv[1:] if argv is None else argv)
        if misplaced:
            return _error(f"{misplaced} (see 'dafka --help')", EXIT_USAGE)
        args = parser.parse_args(argv)
        logging.basicConfig(
            level=getattr(logging, args.log_level),
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
            stream=sys.stderr,
        )
        settings = load_settings(args.config)
        return COMMANDS[args.command](args, settings)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`dafka consume t | head`): quietly, as other
        # Unix tools do; stdout goes to /dev/null so the exit flush is silent.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except ConfigError as exc:
        return _error(exc, EXIT_USAGE)
    except ResumeError as exc:
        return _error(exc, EXIT_NOT_STARTED)  # nothing was published
    except DafkaError as exc:
        return _error(exc, EXIT_FAILURE)
    except zmq.ZMQError as exc:
        if exc.errno not in _ADDRESS_ERRNOS:
            raise
        hint = {
            errno.EADDRINUSE: IN_USE_HINT,
            errno.ENODEV: " (bind takes an interface name, an IP address of this machine or *)",
            errno.EADDRNOTAVAIL: " (that address is not one of this machine's)",
        }.get(exc.errno, "")
        return _error(f"cannot bind: {exc}{hint}", EXIT_FAILURE)
    except OSError as exc:
        # A file or socket problem of this machine: name it, no traceback.
        if exc.filename is not None:
            return _error(f"{exc.filename}: {exc.strerror or exc}", EXIT_FAILURE)
        return _error(exc.strerror or exc, EXIT_FAILURE)
