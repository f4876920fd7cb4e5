"""Speculative decoding. Server side: the speculation figures in OpenAI usage, /generate's
meta_info and /metrics (server.py)."""

from minisgl.extensions.speculative import server

server.register()
