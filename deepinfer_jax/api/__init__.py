"""The public entry points: LLM (generate / stream), Model (the cache-free reference forward), the CLI."""
