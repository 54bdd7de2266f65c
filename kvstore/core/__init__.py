"""Pure logic, no sockets, threads or processes: key placement, message plans, value checks and sums,
the numpy/torch shim, a server's shard state, optimizers and schedules, the file format, snapshots.
"""
