"""The HTTP face of the service: the uvicorn protocol that bounds what a client may send
(`protocol.py`), the ASGI entry (`asgi.py`), the FastAPI app and its routes (`app.py`,
`routes.py`), the fast path that skips FastAPI for the hot endpoints (`fastpath.py`), API keys
(`auth.py`), the OpenAPI pages (`docs.py`, `contract.py`) and the error → HTTP table
(`errors.py`)."""
