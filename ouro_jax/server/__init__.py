"""An OpenAI-compatible HTTP server for the engine (``ouro-jax serve``).

Modules: ``protocol`` (request/response models), ``chat_template`` (the checkpoint's template through
jinja2), ``engine_loop`` (the one thread that owns the ``LLM``), ``metrics`` (Prometheus), ``app``
(FastAPI routes), ``startup`` (engine construction with a timed, cache-aware warm-up),
``cli_commands`` (``serve`` and ``generate``).

Heavy imports stay inside the modules so that ``import ouro_jax.server`` is cheap.
"""
