"""The OpenAI-compatible HTTP server (`deepinfer serve`): app.py builds the FastAPI app,
engine_loop.py runs the engine and gathers each step into one message (messages.py), in a
process of its own (engine_process.py) or on a thread (engine_thread.py); engine_client.py
is the server's side of it; protocol.py holds the request models, sampling.py turns them
into SamplingParams, responses.py writes the responses, errors.py the OpenAI error shape,
metrics.py the Prometheus metrics."""
