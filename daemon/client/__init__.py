"""The trainer side of hotswap: objects a training loop uses to hand checkpoints to the daemon.

Each way in lives in its own module and is re-exported here (one line each).
"""
from daemon.client.broadcast import BroadcastFailed, BroadcastPush, BroadcastResult  # noqa: F401
from daemon.client.publish import PushError, publish_s3, push  # noqa: F401
