"""The OpenAI-compatible HTTP server (`deepinfer serve`): app.py builds the FastAPI app,
engine_thread.py runs the engine loop on its own thread, protocol.py holds the request
models, sampling.py turns them into SamplingParams, responses.py writes the responses,
errors.py the OpenAI error shape, metrics.py the Prometheus metrics."""
