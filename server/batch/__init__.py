"""`ferry batch`: offline batch inference over a file of requests (OpenAI's Batch file format).

Each input line is answered by the HTTP door's own handlers, driven in this process through ASGI
(`local.py`) or sent to a running server (`remote.py`), so a line's answer is exactly what the HTTP
API would give. `requests.py` validates and streams the input, `output.py` owns the output file
(append, resume, torn lines), `run.py` keeps a bounded number of requests in flight and
`ray_run.py` spreads the file over an actor pool of in-process engines with Ray Data.
"""
