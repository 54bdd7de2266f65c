"""Talking between nodes: the wire format (protocol), authentication, zmq sockets (transport), the
request/reply router, the registration handshake, heartbeats, and every address rule.
"""
