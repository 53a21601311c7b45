"""``colibri serve``: an OpenAI-compatible HTTP server for a colibri.hf model, with batched decoding."""
