"""Bind the compiled extension to the libzmq that pyzmq loaded, and check the binding.

pyzmq's wheels carry a private, renamed libzmq and no ``zmq.h``; a second
libzmq in the process would not know pyzmq's sockets.  So the extension links
no libzmq: the addresses of the few functions it calls are looked up here,
through ``ctypes``, in the dependencies of pyzmq's own compiled backend
module, and the result is checked before anything uses it.
"""

from __future__ import annotations

import ctypes
import sys
from types import ModuleType

import zmq


def _backend_file() -> str:
    module = sys.modules.get(zmq.backend.Socket.__module__)
    path = getattr(module, "__file__", None)
    if not path or not path.endswith((".so", ".pyd", ".dylib")):
        raise ImportError(f"pyzmq's backend is not a compiled module ({path})")
    return path


def bind(compiled: ModuleType) -> None:
    """Give ``compiled`` pyzmq's libzmq functions; raise if anything does not match."""
    lib = ctypes.CDLL(_backend_file())
    addresses = {}
    for name in compiled.FUNCTIONS:
        addresses[name] = ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
    compiled.set_functions(addresses)
    if compiled.libzmq_version() != zmq.zmq_version_info():
        raise ImportError(
            f"libzmq {compiled.libzmq_version()} found, pyzmq uses {zmq.zmq_version_info()}"
        )
    ctx = zmq.Context()
    try:
        a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PULL)
        try:
            if compiled.socket_type(a) != zmq.PAIR or compiled.socket_type(b) != zmq.PULL:
                raise ImportError("the bound libzmq does not read pyzmq's sockets")
            # One round trip through pyzmq's own sockets.
            push = ctx.socket(zmq.PUSH)
            try:
                b.bind("inproc://dafka-fastio-check")
                push.connect("inproc://dafka-fastio-check")
                if compiled.send_records(push, b"p", 7, [b"x"]) != 1:
                    raise ImportError("send through the bound libzmq failed")
                if b.poll(2000) and b.recv_multipart() == [b"p" + (7).to_bytes(8, "big"), b"x"]:
                    return
                raise ImportError("a message sent through the bound libzmq did not arrive intact")
            finally:
                push.close(0)
        finally:
            a.close(0)
            b.close(0)
    finally:
        ctx.term()
