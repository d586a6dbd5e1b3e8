"""`python -m nanopaged.serve`: the OpenAI-compatible server on FastAPI + uvicorn
(api_server.py: the app and main; routes.py; middleware.py and exception_handlers.py;
cli_args.py: the flags; serving.py: requests to the engine and back; protocol.py: the
request and response models; metrics.py: /metrics). Chapter 15.
"""
