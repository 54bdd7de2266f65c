"""The worker's side of a distributed store: DistKVStore's data path, its collective calls, the socket
multiplexer driven by the calling threads, and the one store per process.
"""
