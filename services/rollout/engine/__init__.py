"""The CPU engine: an HTTP server with SGLang's native API, backed by transformers.

Workers talk to it exactly as to a real SGLang server (mempo.clients.engine), so tests,
demos and machines without GPUs run the same rollout code. See app.py for the routes,
runtime.py for the continuous-batching scheduler.
"""
