"""The HTTP API: the aiohttp app, its routes (thin handlers that call into ``cluster.node``)
and middlewares, the OpenAPI description and the reference generated from it, the bounds on
connections, and the web console's static files (``console/``, package data).

Imports ``cluster.node`` and what lies below it; never ``rocketmq``, ``process`` or ``cli``.
"""
