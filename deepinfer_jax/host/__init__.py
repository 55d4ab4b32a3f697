"""The host side, plain Python and numpy (never jax): requests, the scheduler, pages and the
prefix cache, the plan builder, grammar matchers, the tokenizer."""
