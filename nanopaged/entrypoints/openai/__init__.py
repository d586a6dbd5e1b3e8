"""`python -m nanopaged.serve`: the OpenAI-compatible server on FastAPI + uvicorn
(api_server.py: the app and its routes; serving.py: requests to the engine and back;
protocol.py: the request and response models; metrics.py: /metrics). Chapter 15.
"""
