"""The Python backend: model.py in processes of their own, with Triton's API and Ferry's short form.

backend.py is the server's side (what the loader and workers see), process.py the server's end of one
model process, child.py the model process itself, faces.py the two faces of a model.py, pb_utils.py
(with pb_config.py, pb_observe.py) the `triton_python_backend_utils` module model code imports, and
protocol.py what the two ends say.
"""
