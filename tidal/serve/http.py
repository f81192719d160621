"""What ``tidal serve`` does at the HTTP level so that one slow or hostile client cannot hurt the others.

- ``read_body``: a body over ``--max_request_bytes`` is refused with 413 *before* it is read: from its
  ``Content-Length`` when it has one, else (chunked upload) as soon as the bytes received pass the limit;
  a body that takes longer than ``--request_timeout`` seconds gets 408.
- ``header_timeout_protocol``: uvicorn's HTTP/1.1 protocol (h11) with a deadline for the request
  headers: a connection that has not sent complete headers ``--request_timeout`` seconds after it opened
  (or after its previous answer) is answered 408 and closed (uvicorn itself waits forever for them; its
  keep-alive timeout starts only after a first answer). The same deadline closes a connection still
  sending a refused body after its answer.
- ``client_gone``: returns when the client disconnects, so a non-streaming request can be aborted
  instead of generating for nobody.
"""

from __future__ import annotations

import asyncio

from tidal.logging import get_logger
from tidal.serve.schema import RequestError

log = get_logger(__name__)

_TIMEOUT_ANSWER = b"HTTP/1.1 408 Request Timeout\r\nconnection: close\r\ncontent-length: 0\r\n\r\n"


class ClientGone(Exception):
    """The client disconnected before its answer: nobody to answer."""


async def read_body(request, max_bytes: int, timeout: float) -> bytes:
    """The request's body, or a ``RequestError``: 413 over ``max_bytes``, 408 slower than ``timeout``."""
    from starlette.requests import ClientDisconnect

    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise RequestError(f"Content-Length must be a byte count, got {declared[:40]!r}")
        _check_size(int(declared), max_bytes)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                size += len(chunk)
                _check_size(size, max_bytes)
                chunks.append(chunk)
    except TimeoutError:
        raise RequestError(
            f"the request body took longer than the server's --request_timeout {timeout:g} s",
            408,
            code="request_timeout",
        ) from None
    except ClientDisconnect:
        raise ClientGone() from None
    return b"".join(chunks)


def _check_size(size: int, max_bytes: int) -> None:
    if size > max_bytes:
        raise RequestError(
            f"the request body is over the server's --max_request_bytes {max_bytes} bytes",
            413,
            code="request_too_large",
        )


async def client_gone(request) -> None:
    """Return once the client has disconnected (call after the body was read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def header_timeout_protocol(seconds: float) -> type:
    """uvicorn's h11 protocol class with a ``seconds`` deadline for each request's headers (module doc);
    pass it as ``uvicorn.Config(http=...)``."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutProtocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            if not self.transport.is_closing():
                self._deadline = self.loop.call_later(seconds, self._overdue)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _overdue(self) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            waiting_headers = self.conn.their_state is h11.IDLE
            answered_still_sending = (
                self.conn.our_state is h11.DONE and self.conn.their_state is h11.SEND_BODY
            )
            if not (waiting_headers or answered_still_sending):
                return  # a request is being served: its handler owns the timing
            partial = bool(self.conn.trailing_data[0])
            log.debug("closing %s: no complete request headers after %g s", self.client, seconds)
            if waiting_headers and partial:  # idle keep-alive connections are closed without a word
                self.transport.write(_TIMEOUT_ANSWER)
            self.transport.close()

    return HeaderTimeoutProtocol
