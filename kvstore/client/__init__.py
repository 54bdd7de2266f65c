"""The worker's side of a distributed store: DistKVStore (``store``) over its one data path (``datapath``:
the sockets, push window, plans, buffers and push counts, and the fast path), its collective calls
(``collective``), the socket multiplexer driven by the calling threads (``mux``), and the one store per
process (``instance``: ``create_dist``, ``process_store``, ``release_process_store``).
"""
