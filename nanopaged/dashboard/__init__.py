"""The live dashboard: what the engine core does, step by step, drawn in a browser.
Its parts: messages.py (the snapshot), sampler.py (built in the core process),
serving.py (DashboardHub: the sampler watched while anyone views, and the stream),
routes.py (DashboardServer: its flags, routes and /metrics series in the HTTP server,
which finds it through its table of server features), replay.py (the tracer's
--export), page/ (the page)."""
