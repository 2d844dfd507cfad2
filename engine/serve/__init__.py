"""``engine serve``: a config behind the OpenAI API with Prometheus metrics.

``loop`` is the only module that touches the engine (a scheduler thread); ``app`` is the HTTP side
(FastAPI on uvicorn); ``protocol`` checks request bodies; ``text`` holds the tokenizer and the
sandboxed chat template; ``metrics`` the Prometheus registry; ``config`` the server's settings;
``bench`` measures the HTTP overhead against an in-process run.
"""
