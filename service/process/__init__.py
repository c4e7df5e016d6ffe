"""The service's processes: the server that binds the port and runs one or more workers
(`server.py`), the supervisor that restarts and recycles them (`supervisor.py`), the optional
shared engine process and its client (`engine_server.py`, `engine_client.py`, spoken over the
pickle-free `wire.py`), and memory accounting (`memory.py`)."""
