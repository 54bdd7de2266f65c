"""The worker's side of a distributed store: DistKVStore's data path (``store``), its collective calls
(``collective``), the socket multiplexer driven by the calling threads (``mux``), and the one store per
process (``process``: ``create_dist``, ``process_store``, ``release_process_store``).
"""
