"""An OpenAI-compatible endpoint on tidal's rollout engine (``tidal serve``).

    from tidal.serve import OpenAIServer, RequestRecorder
    recorder = RequestRecorder()
    with OpenAIServer(engine, "my-model", recorder=recorder) as server:   # port 0: a free port
        openai.OpenAI(base_url=server.base_url, api_key="-").chat.completions.create(...)
    recorder.pop("episode-7")  # the prompt ids, sampled ids and log-probs of that episode's requests

``server.py`` holds the routes, ``protocol.py`` the wire format (``schema.py`` the shared types and
body decoding, ``validation.py`` the request checks, ``responses.py`` the answers), ``http.py`` the
HTTP-level limits (body size, header/body deadlines, disconnects), ``engine_loop.py`` the thread that
owns the engine, ``recorder.py`` the token-in-token-out record. Needs the ``serve`` extra (starlette,
uvicorn), imported only when a server is built.
"""

from tidal.serve.config import ServeConfig
from tidal.serve.recorder import RecordedRequest, RecordedSample, RequestRecorder
from tidal.serve.server import OpenAIServer, OpenAIService

__all__ = [
    "OpenAIServer",
    "OpenAIService",
    "RecordedRequest",
    "RecordedSample",
    "RequestRecorder",
    "ServeConfig",
]
