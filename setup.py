"""Build the optional compiled extensions (everything else is in pyproject.toml).

``dafka.fastio._compiled`` is the mesh's I/O; ``dafka.kafka._compiled`` the
per-record loops of Kafka record batches (pure computation, no library).

The extension links no libzmq and needs no zmq.h (see dafka/fastio/zmq_api.h):
only a C compiler and Python's headers.  A failed build is a warning, and the
installed package then runs the pure-Python twins.
"""

from setuptools import setup

try:
    from Cython.Build import cythonize
except ImportError:  # no Cython: pure-Python install
    ext_modules = []
else:
    from setuptools import Extension

    ext_modules = cythonize(
        [
            Extension(
                "dafka.fastio._compiled",
                ["dafka/fastio/_compiled.pyx"],
                include_dirs=["dafka/fastio"],
                depends=["dafka/fastio/zmq_api.h"],
            ),
            Extension("dafka.kafka._compiled", ["dafka/kafka/_compiled.pyx"]),
        ],
        compiler_directives={"language_level": "3"},
        quiet=True,
    )
    for ext in ext_modules:
        ext.optional = True  # cythonize() drops the flag: a failed compile must not fail the install

setup(ext_modules=ext_modules)
