"""The engine over HTTP: the OpenAI-compatible server and the cache-aware router."""
