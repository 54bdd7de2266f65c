"""Starting clusters: the launch.py CLI, local and ssh roles, Ray and Spark, the tether, the per-role
environment rules, cluster-manager adapters and ``kvstore.node``.  Nothing below imports this package.
"""
