"""The server process (``python -m kvstore.server``): a handler table over a ShardState and its optimizer.
"""
