"""An OpenAI-compatible HTTP server over one `LLM` (`jaxengine serve MODEL`).

`protocol.py` (the request bodies), `sampling.py` (a request's prompts and sampling
parameters), `responses.py` (response bodies and stream chunks), `metrics.py` (Prometheus,
vLLM's names), `app.py` (the FastAPI routes over one `EngineLoop`), `cli.py` (the command).
"""
