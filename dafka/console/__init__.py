"""``dafka console``: a read-only web console of the mesh.

It joins the mesh as an observer, exactly as ``dafka status --watch`` does
(:class:`dafka.cli.status.StatusProbe`), and serves pages of the towers, nodes,
topics, consumer groups (with their lag) and the records themselves: read over
the mesh (FETCHed from the stores, as a consumer reads) or from a local store
(``--db``).  The pages update themselves over server-sent events.
Needs the ``console`` extra (aiohttp): ``pip install 'dafka[console]'``.

:mod:`dafka.console.model` is the sans-IO part, :mod:`dafka.console.probe` the
observer (``dafka status``'s probe that also reads records), :mod:`dafka.console.server`
the observer thread and the web server.  :mod:`dafka.console.soak` and
:mod:`dafka.console.cost` are the memory run and the observer-cost measurement
(``make console-soak``, ``make console-cost``).
"""
