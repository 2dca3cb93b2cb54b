"""What both ends of a socket agree on: the daemon (``kvstore.server``) and its clients
(``kvstore.client``) import these modules, and nothing here imports either of them.

::

    codes.py        ErrorCode, the HTTP status of each, and the exception a client raises
    messages.py     the JSON fields of control messages: namespaces, digests, chunk keys
    strict_json.py  JSON as the daemon reads it: finite, exact numbers, bounded nesting
    frames.py       bulk KV as frames (JSON metadata, then whole stored blocks); Seal
    events.py       session events: the schema engines report and the predictor learns from
    body.py         a body of known length read off a socket into the caller's buffers

Control messages are JSON; bulk KV travels as frames, never base64. Every
block on the wire is a complete stored block (``kvstore.block``), so the
receiver verifies it exactly as it would a block read from LMDB: a network
transfer is a trust boundary. The contract is ``docs/http_api.md``.

May import: the format (``kvstore.errors``, ``keys``, ``block``). Nothing above it.
"""
