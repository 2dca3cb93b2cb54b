"""One exchange over a blocking httpx client.

``StoreClient`` sends every call this way. ``AsyncStoreClient`` sends its bytes
gets and puts this way too, on a worker thread: a get's body is then read
straight off the socket into each block's buffer (``client.get_body``),
which asyncio's streams cannot do (anyio hands a body over as fresh
``bytes`` per read, which h11 buffers and the sink copies again: about half
the throughput), and a put goes out by ``sendall`` (through anyio, a TCP
put of 128 MiB ran ~30% slower).
"""

from __future__ import annotations

from typing import Any

import httpx

from kvstore.client.exchange import Call, Reply
from kvstore.client.failures import from_transport
from kvstore.client.get_body import open_body

# Errors of a connection that died before answering (a keep-alive connection the
# daemon closed, a daemon restart): the call is sent once more, on a new connection.
STALE_CONNECTION = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


def send(http: httpx.Client, call: Call) -> Reply:
    """Send ``call`` and read its answer: a ``200`` frames answer into its sink (off
    the socket where the transport allows), anything else whole into the reply.
    Transport failures raise the ``KVStoreError`` they stand for."""
    try:
        response = _open(http, call)
        try:
            if response.status_code == 200 and call.sink is not None:
                body = open_body(response)
                if body is not None:  # straight off the socket, then closed
                    call.sink.receive(body)
                    return Reply(200)
                for data in response.iter_bytes():
                    call.sink.feed(data)
                call.sink.finish()
                return Reply(200)
            return Reply(response.status_code, response.read())
        finally:
            response.close()
    except httpx.HTTPError as error:
        raise from_transport(error) from error


def _open(http: httpx.Client, call: Call) -> httpx.Response:
    """Send ``call``; the response's body is left unread."""
    try:
        return http.send(_request(http, call), stream=True)
    except STALE_CONNECTION:
        if not call.retry:
            raise
        return http.send(_request(http, call), stream=True)


def _request(http: httpx.Client, call: Call) -> httpx.Request:
    content: Any = call.content if call.body is None else iter(call.body)
    return http.build_request(
        call.method, call.path, json=call.json, content=content, headers=call.headers
    )
