"""`v4jax serve`: a JetStream-style orchestrator over the engine behind OpenAI-compatible HTTP, JetStream's
/v1/generate, health and Prometheus metrics.

    from v4jax import LLM
    from v4jax.serve import ServerOptions, serve
    serve(LLM(), ServerOptions(port=8000))      # blocks until SIGINT / SIGTERM

Modules: engine (the interface the orchestrator drives), orchestrator (threads and queues; text and stop strings
from v4jax.detokenize), protocol (request checks), openai / jetstream (routes), metrics, chat (templates), app
(FastAPI + uvicorn), options (flags). The load generator, `v4jax bench serve`, is v4jax.bench.serve."""
from v4jax.serve.options import ServerOptions


def serve(llm, options: ServerOptions | None = None, **kw) -> int:
    from v4jax.serve.app import serve as _serve
    return _serve(llm, options or ServerOptions(), **kw)


__all__ = ["ServerOptions", "serve"]
