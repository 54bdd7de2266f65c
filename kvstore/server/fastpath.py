"""The server's path for a batch of keys it holds as a group (``kvstore.core.groups``).

A batch PUSH, PUSHPULL or PULL whose list of keys (and sizes) is exactly a group's is answered
with one vectorised operation on the group's flat array, without the per-key checks and views of
the generic handlers (``Server._entries``): the keys were checked when the group was made, and the
message's one array is checked as a whole here.  Any other message, or one that does not match its
group in every field, returns False and takes the generic path, which raises the usual errors.
Both functions take the server's :class:`~kvstore.server.requests.Requests`, not the server.
"""

from __future__ import annotations

from kvstore.net.protocol import Message
from kvstore.server.requests import Batch, Requests


def push(requests: Requests, identity: bytes, msg: Message, pull: bool, bf16: bool,
         rounds: list[int] | None = None) -> bool:
    """Serve a batch PUSH (PUSHPULL with ``pull``) of a group; False when the generic path must.
    ``rounds``: the push's checked ``rounds`` (each key's number in the worker's count), which a
    dist_async group keeps for the shard's screen of retries.

    Raises what the generic path raises for the same request (nothing is changed then)."""
    body, state = msg.body, requests.state
    if body.get("lo") is not None or len(msg.arrays) != 1 or not state.grouping:
        return False
    keys = body.get("keys")
    group = state.group_of(keys, body.get("sizes"), msg.arrays[0], create=True)
    if group is None:
        return False
    requests.sender(msg)
    requests.check_precision(keys, bf16, msg.op.name)
    requests.check_updatable(keys[0], group.dtype)
    batch = Batch(identity, msg.seq, len(keys), bf16)
    requests.reply_all(state.push_group(group, msg.sender, (batch, -1), msg.arrays[0], pull, rounds))
    return True


def pull(requests: Requests, identity: bytes, msg: Message) -> bool:
    """Serve a batch PULL of a group; False when the generic path must (it raises what is wrong)."""
    body, state = msg.body, requests.state
    if body.get("lo") is not None or msg.arrays or not state.grouping:
        return False
    keys = body.get("keys")
    group = state.group_of(keys, body.get("sizes"), None, create=False)
    if group is None:
        return False
    requests.sender(msg)
    batch = Batch(identity, msg.seq, len(keys), keys[0] in requests.bf16_keys)
    requests.reply_all(state.pull_group(group, msg.sender, (batch, -1)))
    return True
