"""Chapter 09: serving. An OpenAI-compatible HTTP server over the engine (`python -m nanoserve serve`).

    protocol   the request checks and the response/stream shapes (OpenAI's)
    chat       chat messages to a prompt (the tokenizer's template, or the course's default)
    metrics    /metrics with vLLM's names (prometheus_client)
    app        the routes (FastAPI), streaming, errors, auth, 429s
    server     the command line and uvicorn, graceful shutdown
    load       the load client `bench-serve` (what `vllm bench serve` measures)
    clients    guidellm and aiperf against a server, beside `load`, for the same load (tooling)
    naive      the peer: a server without an engine, one transformers `generate` at a time

The engine loop itself runs in `nanoserve.engine.async_engine.AsyncLLMEngine`.
"""
