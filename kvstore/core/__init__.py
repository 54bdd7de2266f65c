"""Pure logic, no sockets, threads or processes: key placement, message plans, the dtype table, value
checks and sums, the numpy/torch shim, a server's shard state and its sync rounds, optimizers (base
class, update rules, registry) and schedules, the file format, snapshots.
"""
