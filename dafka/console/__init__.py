"""``dafka console``: a read-only web console of the mesh.

It joins the mesh as an observer, exactly as ``dafka status --watch`` does
(:class:`dafka.cli.status.StatusProbe`), and serves pages of the towers, nodes,
topics, consumer groups (with their lag) and, from a local store (``--db``),
the records themselves.  The pages update themselves over server-sent events.
Needs the ``console`` extra (aiohttp): ``pip install 'dafka[console]'``.

:mod:`dafka.console.model` is the sans-IO part, :mod:`dafka.console.server` the
observer thread and the web server.
"""
